"""Every fidelity case: the decisions vLLM 0.33's own scheduler made, step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.sim.decisions import decision_record
from engine.sim.driver import simulate
from engine.sim.workload import load_workload

CASES = Path(__file__).parent / "data" / "fidelity"
COMPARED = (
    "step",
    "arrived",
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
)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "case", sorted(p.name.removesuffix(".workload.json") for p in CASES.glob("*.workload.json"))
)
def test_case_reproduces_vllm_step_for_step(case: str, mode: str) -> None:
    # NAME.async.decisions.jsonl: vLLM's AsyncScheduler with two batches in flight, made
    # by bench/vllm_oracle.py with config.async_scheduling=true.
    suffix = ".async" if mode == "async" else ""
    expected = [
        json.loads(line)
        for line in (CASES / f"{case}{suffix}.decisions.jsonl").read_text().splitlines()
    ]
    got: list[dict] = []
    simulate(
        load_workload(CASES / f"{case}.workload.json", {"async_scheduling": mode == "async"}),
        on_step=lambda r, e: got.append(decision_record(r, e)),
    )
    assert len(got) == len(expected), "number of steps"
    for want, have in zip(expected, got):
        step = want["step"]
        # Scheduling order matters, so compare as ordered pairs, not as dicts.
        assert list(have["scheduled"].items()) == list(want["scheduled"].items()), step
        for key in COMPARED:
            if key in want:
                assert have[key] == want[key], f"step {step}: {key}"
