"""Speculative decoding through the whole trace path: for random workloads with drafts
(simulated or n-gram; rejections, budget-truncated drafts, preemptions with drafts in
flight, stops inside accepted drafts), the reducer rebuilds the engine's state after every
step, and re-simulation reproduces every decision, from the streamed trace and from
scripts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import SpeculativeConfig
from engine.sim.workload import SimWorkload, parse_workload
from replays.export import export_perfetto
from replays.resim import resimulate
from replays.stats import trace_stats
from tests.helpers import record, write_trace
from tests.test_recorder import check_recording
from tests.test_scheduler_props import workloads


@st.composite
def spec_workloads(draw: st.DrawFn) -> SimWorkload:
    w = draw(workloads())
    k = draw(st.sampled_from([1, 2, 3, 5]))
    if draw(st.booleans()):  # the simulated drafter: k drafts, right for a random prefix
        return dataclasses.replace(w, config=w.config.replace(num_speculative_tokens=k))
    lo = draw(st.integers(1, 3))
    spec = SpeculativeConfig("ngram", k, lo + draw(st.integers(0, 2)), lo)
    return dataclasses.replace(w, config=w.config.replace(speculative_config=spec))


def check_trace(w: SimWorkload, tmp_path: Path) -> None:
    run = record(w, snapshot_interval=5)
    check_recording(run, tmp_path)
    path = write_trace(tmp_path, run.data, "spec.trace")
    faithful = resimulate(path)
    assert faithful.mode == "faithful" and faithful.reproduced, faithful.divergence
    scripted = resimulate(path, scripted=True)
    assert scripted.reproduced, scripted.divergence
    trace_stats(path)
    export_perfetto(path, tmp_path / "spec.json")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec_workloads())
def test_random_spec_workloads_read_and_resimulate(tmp_path_factory, w: SimWorkload) -> None:  # type: ignore[no-untyped-def]
    check_trace(w, tmp_path_factory.mktemp("spec"))


def test_rejected_drafts_without_prefix_caching(tmp_path: Path) -> None:
    """The issue's minimal repro: blocks filled by accepted drafts used to be hashed with
    prefix caching off, so the engine freed them to the head of the free queue and the
    reducer (seeing a hash) to the tail."""
    w = parse_workload(
        {
            "config": {
                "block_size": 7,
                "num_blocks": 68,
                "enable_prefix_caching": False,
                "num_speculative_tokens": 2,
            },
            "requests": [
                {"id": "a", "prompt_token_ids": [76], "max_tokens": 14},
                {"id": "b", "arrival_step": 4, "prompt_token_ids": [26], "max_tokens": 42},
            ],
        },
        source="test",
    )
    run = record(w)
    assert any(s.num_spec_tokens > 0 for r in run.reports for s in r.scheduled)
    assert any(
        r.spec_accepted and not all(a.accepted for a in r.spec_accepted) for r in run.reports
    )
    check_trace(w, tmp_path)
