"""Async scheduling (vLLM's AsyncScheduler) in sim, recordings and re-simulation."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.sim.api import run_sim
from engine.sim.workload import load_workload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from recorder.schema import Step
from replays.resim import resimulate

CASES = Path(__file__).parent / "data" / "fidelity"


def record(tmp_path: Path, case: str, **overrides: object) -> Path:
    trace = tmp_path / f"{case}.trace"
    workload = load_workload(CASES / f"{case}.workload.json", dict(overrides))
    run_sim(workload, on_engine=lambda e: open_recording(e, trace, live=False))
    return trace


@pytest.mark.parametrize("case", ["c_kv_pressure_prefix", "e_priority_unschedule"])
def test_an_async_trace_resimulates_to_the_same_decisions(tmp_path: Path, case: str) -> None:
    trace = record(tmp_path, case, async_scheduling=True)
    with TraceReader(trace) as reader:
        assert reader.header.config["async_scheduling"] is True
    result = resimulate(trace)
    assert result.reproduced, result.divergence
    assert result.num_steps == result.num_recorded_steps > 10


def test_async_samples_arrive_one_step_after_their_batch(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "a").mkdir()
    sync = record(tmp_path / "s", "a_decode_plus_arrival")
    asy = record(tmp_path / "a", "a_decode_plus_arrival", async_scheduling=True)

    def first_sample_step(path: Path) -> int:
        with TraceReader(path) as reader:
            for e in reader.entries():
                rec = e.record
                if isinstance(rec, Step) and (rec.sampled_tokens or rec.other_samples):
                    return rec.step
        raise AssertionError("no samples")

    assert first_sample_step(asy) == first_sample_step(sync) + 1


def test_a_what_if_switch_to_async_is_a_different_run(tmp_path: Path) -> None:
    trace = record(tmp_path, "e_priority_preemption")
    result = resimulate(trace, {"async_scheduling": True}, out=tmp_path / "async.trace")
    assert result.mode == "scripted"
    assert not result.reproduced


def test_async_scheduling_with_speculative_decoding_is_refused() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(async_scheduling=True, num_speculative_tokens=2)
