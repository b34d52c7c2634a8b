"""Async scheduling traces recorded inside vLLM's real engine loop re-simulate exactly
(issue 25, item 2): with prefix caching off (vLLM's async scheduler caches nothing then),
and at the end of a run (an in-process engine core is not drained after the last finish).

The two traces are the issue's repro: recorded by recorder.vllm.RecordingScheduler inside
vLLM 0.33's LLMEngine (in-process, async_scheduling=True) with a model-free executor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.records import KVKind
from engine.sim.api import run_sim
from engine.sim.workload import load_workload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from replays.diff import diff_traces
from replays.resim import resimulate
from replays.run_end import run_is_over
from tests.test_vllm import find_vllm_python

DATA = Path(__file__).parent / "data"
TRACES = {
    # block_size 32, 9 blocks, prefix caching off, 22 preemptions
    "prefix_caching_off": DATA / "vllm_async_prefix_caching_off_block32.trace",
    # block_size 16, prefix caching on: ends with the step whose update finished the last
    # request, a batch still queued
    "trailing_steps": DATA / "vllm_async_trailing_steps.trace",
}


@pytest.mark.parametrize("name", list(TRACES))
def test_vllm_async_traces_resimulate_exactly(name: str, tmp_path: Path) -> None:
    trace = TRACES[name]
    with TraceReader(trace) as reader:
        assert "AsyncScheduler" in reader.header.engine
    out = tmp_path / "resim.trace"
    result = resimulate(trace, out=out)
    assert result.reproduced, result.divergence
    assert result.num_steps == result.num_recorded_steps
    # The re-simulated trace is itself valid: the reader rebuilds every step of it.
    d = diff_traces(trace, out)
    assert d.first_step is None, d.fields


def test_without_prefix_caching_the_async_scheduler_caches_no_block(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    workload = load_workload(
        DATA / "fidelity" / "c_kv_pressure_prefix.workload.json",
        {"async_scheduling": True, "enable_prefix_caching": False},
    )
    run_sim(workload, on_engine=lambda e: open_recording(e, trace, live=False))
    with TraceReader(trace) as reader:
        kinds = {k for s in reader.steps() for k in s.kv_events.kinds}
    assert KVKind.ALLOCATED in kinds and KVKind.CACHED not in kinds
    assert resimulate(trace).reproduced


def test_a_run_drains_batches_in_flight_only_as_far_as_the_recording_did() -> None:
    # Inputs still to come, or a request unfinished: never over.
    assert not run_is_over(3, 5, 2, False, False)
    assert not run_is_over(9, 5, 2, True, False)
    # Nothing left at all: over.
    assert run_is_over(9, 5, 20, False, False)
    # Only a batch in flight: drained while the recording has steps (vLLM's busy loop),
    # not after (an in-process engine core whose client stopped stepping it) ...
    assert not run_is_over(9, 5, 11, False, True)
    assert run_is_over(11, 5, 11, False, True)
    # ... and always without a recording to follow (a workload), as the busy loop does.
    assert not run_is_over(100, 5, None, False, True)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRACES))
def test_vllm_async_traces_resimulate_exactly_with_vllm(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from replays.vllm_resim import resimulate_with_vllm

    monkeypatch.setenv("SCHEDTOP_VLLM_PYTHON", find_vllm_python())
    trace = TRACES[name]
    with TraceReader(trace) as reader:
        num_recorded = reader.index().last_step + 1
    result = resimulate_with_vllm(trace, out=tmp_path / "vllm.trace")
    assert result.reproduced, (result.divergence_step, result.fields)
    assert result.num_steps == num_recorded


@pytest.mark.vllm
@pytest.mark.slow
def test_async_traces_of_vllms_engine_loop_resimulate_with_both_engines(tmp_path: Path) -> None:
    """A few workloads of bench/vllm_engine_fuzz.py (docs/benchmarks.md has its long runs):
    vLLM's LLMEngine with async scheduling, recorded, re-simulated by both schedulers."""
    spec = importlib.util.spec_from_file_location(
        "vllm_engine_fuzz", Path(__file__).parent.parent / "bench" / "vllm_engine_fuzz.py"
    )
    assert spec is not None and spec.loader is not None
    fuzz = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = fuzz  # its dataclasses look their module up there
    spec.loader.exec_module(fuzz)
    outcome = fuzz.fuzz(6, 2, find_vllm_python(), tmp_path)
    assert not outcome.problems, outcome.problems
    # What it has to cover: storms, aborts, prefix caching both ways, both block sizes,
    # both ends of a run.
    assert outcome.preemptions > 0 and outcome.aborts > 0
    assert 0 < outcome.caching_off < outcome.runs
    assert set(outcome.block_sizes) == {16, 32}
    assert 0 < outcome.drained < outcome.runs
