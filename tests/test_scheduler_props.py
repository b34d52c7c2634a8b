"""Property tests over random workloads: invariants after every step, termination,
determinism."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.records import entry_refs, entry_tokens
from engine.sim.decisions import decision_record
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload, parse_workload


@st.composite
def workloads(draw: st.DrawFn) -> SimWorkload:
    bs = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.sampled_from([64, 256, 2048]))
    num_blocks = draw(st.integers(4, 64))
    max_num_seqs = draw(st.integers(1, 8))
    config: dict[str, Any] = dict(
        block_size=bs,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, draw(st.sampled_from([8, 32, 100, 512]))),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 8, 24])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.2])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 0, 2])),
    )
    prefix = draw(st.lists(st.integers(0, 30), max_size=3 * bs))
    requests = []
    for i in range(draw(st.integers(1, 10))):
        own = draw(st.lists(st.integers(0, 30), min_size=1, max_size=80))
        prompt = ((prefix if draw(st.booleans()) else []) + own)[: max_model_len - 1]
        max_tokens = draw(st.integers(1, 30))
        requests.append(
            dict(
                id=f"r{i}",
                arrival_step=draw(st.integers(0, 12)),
                prompt_token_ids=prompt,
                output_token_ids=draw(st.lists(st.integers(0, 30), max_size=max_tokens)),
                max_tokens=max_tokens,
                priority=draw(st.integers(0, 3)),
            )
        )
    return parse_workload({"config": config, "requests": requests}, source="hypothesis")


def run_checked(w: SimWorkload) -> list[dict[str, Any]]:
    engine = make_engine(w)
    cfg = w.config
    decisions = []
    finished: set[str] = set()
    for result in run_steps(w, engine):
        rep = result.report
        engine.scheduler.kv.check_invariants()
        assert rep.num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(engine.scheduler.running) <= cfg.max_num_seqs
        assert not (rep.preemptions and rep.admissions), "admitted in a step that preempted"
        for s in rep.scheduled:
            assert s.num_tokens > 0
        # The entries' columns (Entries: the scheduled requests) and their records (built
        # on reading; a priority preemption that takes an entry back shifts the rest) agree.
        assert entry_refs(rep.scheduled) == tuple(s.ref for s in rep.scheduled)
        assert entry_tokens(rep.scheduled) == sum(s.num_tokens for s in rep.scheduled)
        assert rep.free_blocks == engine.scheduler.kv.num_free_blocks
        finished |= {result.names[f.ref] for f in rep.finishes}
        decisions.append(decision_record(result, engine))
    assert finished == {r.id for r in w.requests}, "every request finishes"
    assert not engine.scheduler.kv.req_to_blocks, "no blocks held at the end"
    assert engine.scheduler.kv.num_free_blocks == cfg.usable_blocks
    return decisions


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_invariants_hold_and_every_request_finishes(w: SimWorkload) -> None:
    run_checked(w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_two_runs_decide_identically(w: SimWorkload) -> None:
    assert run_checked(w) == run_checked(w)
