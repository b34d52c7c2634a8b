"""The flight recorder survives a hang followed by SIGKILL (issue 25, item 1): the trace
of an engine that stops stepping and is then killed reads up to its last busy step,
because the recorder's own thread flushes on a timer (RecorderOptions(flush_interval_s=...)),
not only when the engine steps. Real processes, real files: our engine recorded as
`schedtop run` and `schedtop serve` record it, the real `schedtop serve` (tiny model) hung
by its test hook ($SCHEDTOP_TEST_HANG_AFTER_STEPS), and (marked vllm) vLLM's real engine
loop, sync and async, with recorder.vllm.

No timing is asserted: the test waits (with a generous deadline) for the trace to reach
the last step; without the timer it never does, however long the engine hangs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from recorder.background import Background
from recorder.multi import open_trace
from replays.resim import resimulate
from schedtop_server.loop import HANG_AFTER_STEPS_ENV
from tests.model_support import write_tiny_gguf
from tests.serve_support import ServerProcess
from tests.test_vllm import find_vllm_python, vllm_env

ROOT = Path(__file__).resolve().parent.parent
START_S = 300.0  # a vLLM engine's start on a busy two-core machine
FLUSH_WAIT_S = 60.0  # far beyond the flush interval: only a missing flush takes this long


def last_step_in(path: Path) -> int:
    """The last step a reader finds in the (unclosed, maybe cut) trace; -1: none."""
    try:
        with open_trace(path) as reader:
            return max((s.step for s in reader.steps()), default=-1)
    except Exception:  # not even a header yet
        return -1


def hang_then_kill(
    cmd: list[str], env: dict[str, str], trace: Callable[[], Path], marker: Path
) -> int:
    """Run `cmd` until it writes `marker` (the last step it recorded) and hangs; wait for
    the trace to hold that step; SIGKILL it. Returns the step the marker named."""
    log = marker.with_name(marker.name + ".stderr")  # a file: a full pipe would block it
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + START_S
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"it exited ({proc.returncode}): {log.read_text()[-2000:]}")
            assert time.monotonic() < deadline, "it never hung"
            time.sleep(0.2)
        time.sleep(0.1)  # the marker's text is written
        last = int(marker.read_text())
        deadline = time.monotonic() + FLUSH_WAIT_S
        while last_step_in(trace()) < last and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "it was to hang, not exit"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return last


@pytest.mark.parametrize("mode", ["run", "serve"])
def test_a_hung_engine_killed_keeps_its_last_steps(mode: str, tmp_path: Path) -> None:
    trace = tmp_path / ("run.trace" if mode == "run" else "serve-run")
    marker = Path(str(trace) + ".hung")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.hang_child", mode, str(trace), "300"]
    last = hang_then_kill(cmd, env, lambda: trace, marker)
    assert last == 299
    assert last_step_in(trace) == last
    with open_trace(trace) as reader:
        assert not reader.closed_cleanly  # killed: no footer, and yet every step


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("is_async", "segments"),
    [(False, False), (True, False), (True, True)],
    ids=["sync", "async", "async-segments"],
)
def test_a_hung_vllm_engine_killed_keeps_its_last_steps(
    is_async: bool, segments: bool, tmp_path: Path
) -> None:
    """segments: SCHEDTOP_TRACE_MAX_BYTES (recorder.vllm.live): a run directory, whose
    segments' recorders keep the same flush timer."""
    python = find_vllm_python()
    requests = [
        {
            "id": f"r{i}",
            "arrival_step": i,
            "prompt_token_ids": list(range(1, 40 + i)),
            "max_tokens": 400,
            "output_token_ids": [7] * 400,
        }
        for i in range(4)
    ]
    workload = {"config": {"block_size": 16, "num_blocks": 200}, "requests": requests}
    root = tmp_path / "root"
    spec = {
        "root": str(root),
        "check": False,
        "runs": [
            {
                "name": "hang",
                "workload": workload,
                "multiprocess": False,
                "async_scheduling": is_async,
                # vLLM's engine stops stepping after 300 steps, its requests unfinished.
                "hang_after_steps": 300,
            }
        ],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    # The default interval (1 s) holds too; a shorter one keeps the test short.
    env = {**vllm_env(), "SCHEDTOP_FLUSH_INTERVAL_S": "0.25"}
    if segments:
        env["SCHEDTOP_TRACE_MAX_BYTES"] = "1GiB"
    cmd = [python, "-m", "tests.vllm_engine", str(tmp_path / "spec.json"), str(tmp_path / "o")]
    marker = root / "hang" / "hung"
    (root / "hang").mkdir(parents=True)
    trace_dir = root / "hang"

    def the_trace() -> Path:
        if segments:
            runs = sorted(p for p in trace_dir.iterdir() if p.is_dir())
            return runs[0] if runs else trace_dir / "none"
        found = sorted(trace_dir.glob("*.trace"))
        return found[0] if found else trace_dir / "none.trace"

    last = hang_then_kill(cmd, env, the_trace, marker)
    assert last >= 295  # every step driven was recorded but the open one (async)
    assert last_step_in(the_trace()) == last
    # The killed trace is an incident to debug: it re-simulates up to where it ends.
    result = resimulate(the_trace())
    assert result.reproduced, result.divergence
    assert result.num_steps == last + 1


def test_the_timer_runs_queued_jobs_and_ticks_while_nothing_wakes_it() -> None:
    ran: list[int] = []
    ticked = threading.Event()
    bg = Background(tick=lambda: ran and ticked.set(), tick_s=0.05)
    try:
        bg.put(ran.append, 1)  # far fewer than WAKE_EVERY: put() does not wake the thread
        assert ticked.wait(30)
        assert ran == [1] and bg.pending == 0
    finally:
        bg.close()


def test_a_flush_interval_must_be_positive() -> None:
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.sim.runner import SimRunner
    from recorder.recorder import Recorder, RecorderOptions
    from recorder.writer import NullWriter

    engine = EngineCore(EngineConfig(), SimRunner({}))
    with pytest.raises(ValueError, match="flush_interval_s"):
        Recorder(engine, NullWriter(), RecorderOptions(flush_interval_s=0))


def test_a_hung_schedtop_serve_killed_keeps_its_last_steps(tmp_path: Path) -> None:
    """The real `schedtop serve` (a tiny model), its engine thread hung by the test hook
    while a request decodes, then SIGKILLed: its run directory reads up to that step."""
    model = write_tiny_gguf(tmp_path)
    traces = tmp_path / "traces"
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--trace-dir", str(traces)]
    env = {HANG_AFTER_STEPS_ENV: "40", "SCHEDTOP_FLUSH_INTERVAL_S": "1"}
    with ServerProcess(args, env=env) as server:
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

        def ask() -> None:  # never answered: the engine hangs mid-request
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(server.url + "/v1/completions", json=body, timeout=FLUSH_WAIT_S * 2)

        threading.Thread(target=ask, daemon=True).start()
        deadline = time.monotonic() + START_S
        said = "the engine thread hangs after step "
        while not any(said in line for line in server.output):
            assert time.monotonic() < deadline, "".join(server.output)[-2000:]
            time.sleep(0.2)
        line = next(line for line in server.output if said in line)
        last = int(line.split(said)[1].split()[0])
        (run,) = [p for p in traces.iterdir() if p.is_dir()]
        deadline = time.monotonic() + FLUSH_WAIT_S
        while last_step_in(run) < last and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
    assert last == 39
    assert last_step_in(run) == last
