"""A recording that stops before the engine does says why (issue 25, item 7): the footer
keeps the reason, `schedtop info` shows it instead of "closed cleanly", and `resim`
checks the steps it has (its requests still running were no longer recorded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.sim.driver import simulate
from engine.sim.workload import load_workload
from recorder.info import format_summary, summarize
from recorder.reader import TraceReader
from recorder.recorder import Recorder
from recorder.writer import TraceWriter
from replays.resim import resimulate
from tests.test_vllm import find_vllm_python, record_in_vllm

CASES = Path(__file__).parent / "data" / "fidelity"


def record_part(tmp_path: Path, steps: int, stopped: str, **overrides: object) -> Path:
    """The first `steps` steps of a fidelity case, then the recorder closes with
    `stopped` while the engine would go on."""
    trace = tmp_path / "t.trace"
    workload = load_workload(CASES / "c_kv_pressure_prefix.workload.json", dict(overrides))
    holder: list[Recorder] = []

    def attach(engine: object) -> None:
        holder.append(Recorder(engine, TraceWriter(trace, live=False)))  # type: ignore[arg-type]

    class Stop(Exception):
        pass

    def on_step(result: object, engine: object) -> None:
        if result.report.step + 1 == steps:  # type: ignore[attr-defined]
            holder[0].close(stopped)
            raise Stop

    with pytest.raises(Stop):
        simulate(workload, on_engine=attach, on_step=on_step)
    return trace


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_info_says_why_recording_stopped_and_resim_checks_what_it_has(
    tmp_path: Path, is_async: bool
) -> None:
    why = "request 'x' uses a cache salt, which is not recorded"
    trace = record_part(tmp_path, 12, why, async_scheduling=is_async)
    summary = summarize(trace)
    assert summary.closed_cleanly and summary.stopped == why
    text = format_summary(summary)
    assert "recording stopped before the engine did" in text and "cache salt" in text
    assert "closed cleanly" not in text
    result = resimulate(trace)
    assert result.reproduced, result.divergence
    assert result.num_steps == result.num_recorded_steps == 12


def test_a_clean_close_says_so(tmp_path: Path) -> None:
    trace = record_part(tmp_path, 12, "")
    summary = summarize(trace)
    assert summary.stopped == ""
    assert "yes, cleanly" in format_summary(summary)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_vllm_trace_stopped_by_a_cache_salt_says_so(tmp_path: Path, is_async: bool) -> None:
    python = find_vllm_python()
    requests = [
        {
            "id": f"r{i}",
            "arrival_step": 0 if i < 2 else 6,
            "prompt_token_ids": list(range(1, 30 + i)),
            "max_tokens": 20,
            "output_token_ids": [7] * 20,
            **({"cache_salt": "tenant-a"} if i == 2 else {}),
        }
        for i in range(3)
    ]
    run = {
        "name": "salt",
        "workload": {"config": {"num_blocks": 64}, "requests": requests},
        "multiprocess": False,
        "async_scheduling": is_async,
    }
    result = record_in_vllm(python, tmp_path, [run])["salt"]
    assert "error" not in result, result
    assert sorted(result["finished"]) == ["r0", "r1", "r2"]  # vLLM went on
    trace = next((tmp_path / "salt").glob("*.trace"))
    summary = summarize(trace)
    assert "cache salt" in summary.stopped and "'r2" in summary.stopped
    assert "recording stopped before the engine did" in format_summary(summary)
    with TraceReader(trace) as reader:
        assert reader.index().last_step < result["steps"] - 1
    resim = resimulate(trace)
    assert resim.reproduced, resim.divergence
