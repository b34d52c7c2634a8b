"""Scheduler fidelity with n-gram drafts, against vLLM 0.33's own scheduler. The stored
cases were made by `bench/vllm_diff_fuzz.py --spec`, which drove vLLM's Scheduler
(bench/vllm_spec_oracle.py: the same scripted model, drafts handed over with
`update_draft_token_ids`) on random workloads; this test needs no vLLM. Every step must
match: scheduled tokens and order, drafts verified and accepted per request, preemptions,
admissions, finishes, free blocks, queues, computed tokens and block tables. Together the
cases cover accepted and rejected drafts, drafts cut by the token budget, the preemption
of a request holding drafts, and vLLM's padding of one-token admissions to 1 + k rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.records import Reason
from engine.sim.decisions import decision_record
from engine.sim.driver import simulate
from engine.sim.workload import parse_workload

CASES = sorted((Path(__file__).parent / "data" / "vllm_spec").glob("*.workload.json"))
KEYS = (
    "scheduled",
    "spec",
    "preempted",
    "preemptions",
    "admitted",
    "finished",
    "num_free_blocks",
    "num_free_blocks_after_schedule",
    "running",
    "waiting",
    "num_computed_tokens",
    "block_tables",
    "arrived",
    "sampled",
)


def ours(workload: dict[str, Any]) -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = []

    def record(result: Any, engine: Any) -> None:
        rep, names = result.report, result.names
        accepted = {a.ref: a.accepted for a in rep.spec_accepted}
        step = decision_record(result, engine)
        step["spec"] = {
            names[s.ref]: [s.num_spec_tokens, accepted.get(s.ref, 0)]
            for s in rep.scheduled
            if s.num_spec_tokens
        }
        steps.append(step)

    simulate(parse_workload(workload, source="vllm case"), on_step=record)
    return steps


def vllm(case: Path) -> list[dict[str, Any]]:
    path = case.with_name(case.name.replace(".workload.json", ".decisions.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name.removesuffix(".workload.json"))
def test_every_decision_matches_vllm(case: Path) -> None:
    expected = vllm(case)
    got = ours(json.loads(case.read_text()))
    assert len(got) == len(expected)
    for want, have in zip(expected, got):
        for key in KEYS:
            a, b = want[key], have[key]
            if key == "scheduled":
                a, b = list(a.items()), list(b.items())  # the order is a decision too
            assert a == b, f"step {want['step']}: {key}"


def features(workload: dict[str, Any]) -> dict[str, int]:
    """What a case exercises, counted on our run (whose decisions equal vLLM's)."""
    out = dict.fromkeys(("accepted", "rejected", "padded", "truncated", "preempted"), 0)
    holding: set[int] = set()  # requests with drafts proposed and not yet verified

    def record(result: Any, engine: Any) -> None:
        rep = result.report
        accepted = {a.ref: a.accepted for a in rep.spec_accepted}
        admitted = {a.ref for a in rep.admissions}
        cut = {s.ref for s in rep.shortfalls if s.reason == Reason.TOKEN_BUDGET}
        out["preempted"] += sum(p.victim in holding for p in rep.preemptions)
        for e in rep.scheduled:
            if e.num_spec_tokens:
                out["accepted"] += accepted.get(e.ref, 0)
                out["rejected"] += e.num_spec_tokens - accepted.get(e.ref, 0)
                out["padded"] += e.ref in admitted
                out["truncated"] += e.ref in cut
            holding.discard(e.ref)
        holding.update(p.ref for p in rep.spec_proposed)

    simulate(parse_workload(workload, source="vllm case"), on_step=record)
    return out


def test_the_cases_cover_the_spec_decisions() -> None:
    assert CASES, "the stored vLLM cases are missing"
    total: dict[str, int] = {}
    for case in CASES:
        for key, n in features(json.loads(case.read_text())).items():
            total[key] = total.get(key, 0) + n
    assert all(total.values()), total
