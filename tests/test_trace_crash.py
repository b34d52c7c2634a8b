"""Crash safety: a real recording process is SIGKILLed at 20 random moments. Each time,
the reader returns every step up to the last one the process had flushed, with no error
but the reported cut, and the state rebuilt from them holds together."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from recorder.errors import TraceError
from recorder.reader import TraceReader
from recorder.schema import Snapshot, Step
from replays.reducer import apply
from replays.state import State

ROOT = Path(__file__).resolve().parent.parent
MODES = ("live", "batch", "torn")


def run_and_kill(module: str, args: list[str], steps: int, delay_s: float) -> tuple[list[str], int]:
    """Run the recording child `python -m module args...` until it has printed `steps`
    lines, wait `delay_s`, SIGKILL it. Returns every line it printed and its exit status."""
    child = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    lines: list[str] = []
    for line in child.stdout:
        lines.append(line.strip())
        if len(lines) >= steps:
            break
    if delay_s:
        subprocess.run(["sleep", f"{delay_s:.4f}"], check=True)
    child.kill()
    lines += child.stdout.read().split()
    status = child.wait()
    child.stdout.close()
    return lines, status


def last_reported_step(lines: list[str]) -> int:
    """The last step the child reported flushed (-1: none)."""
    return max((int(x) for x in lines if x.lstrip("-").isdigit()), default=-1)


def kill_at_random(path: Path, mode: str, steps_before_kill: int, delay_s: float) -> int:
    """Run the child until it has done `steps_before_kill` steps, wait `delay_s`, SIGKILL
    it. Returns the last step it reported flushed (-2 if it finished first)."""
    lines, status = run_and_kill("tests.crash_child", [str(path), mode], steps_before_kill, delay_s)
    if "done" in lines:
        return -2
    assert status == -signal.SIGKILL, f"the {mode} child died by itself (status {status})"
    return last_reported_step(lines)


def check_trace(path: Path, flushed: int) -> bool:
    """Check the killed process's trace; returns whether its tail was cut mid-record."""
    try:
        reader = TraceReader(path)
    except TraceError as e:  # killed before the header reached the file
        assert e.incomplete and flushed < 0, e
        return True
    with reader:
        state: State | None = None
        last = -1
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Snapshot):
                assert state is not None and state.to_snapshot() == rec
            elif isinstance(rec, Step):
                state = state or State.initial(reader.header)
                apply(state, rec, entry.offset)
                assert rec.step == last + 1
                last = rec.step
        assert not reader.closed_cleanly
        assert last >= flushed, f"step {flushed} was flushed but the trace ends at {last}"
        cut = reader.cut is not None
    if state is not None:
        state.check_invariants()
    return cut


@pytest.mark.slow
def test_sigkill_at_20_random_moments(tmp_path: Path) -> None:
    rng = random.Random(20240)
    plans = [
        (
            tmp_path / f"kill{i}.trace",
            MODES[i % 3],
            rng.randint(1, 400),
            rng.choice([0.0, rng.random() * 0.004]),
        )
        for i in range(20)
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        flushed = list(pool.map(lambda plan: kill_at_random(*plan), plans))
    cut = 0
    for (path, mode, steps, _), last_flushed in zip(plans, flushed):
        assert last_flushed != -2, f"{mode} child finished before step {steps}"
        cut += check_trace(path, last_flushed)
    assert sum(f >= 0 for f in flushed) >= 15  # most kills came after steps were on disk
    assert cut >= 3  # the torn writes did leave records cut in the middle
