"""Crash safety of a segmented recording: a real recording process is SIGKILLed at random
moments, mid-rotation included. Each time the directory reads as one trace holding every
step the process had flushed, the kept segments stay under the bound, and the state
rebuilt from the first kept snapshot holds together."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from recorder.multi import SegmentedReader, open_trace
from recorder.schema import Snapshot, Step
from recorder.segments import list_segments
from replays.reducer import apply
from replays.state import State
from tests.test_trace_crash import last_reported_step, run_and_kill

BOUND = 256 << 10  # segments of 32 KiB: a rotation every few dozen steps


def kill(directory: Path, steps: int, delay_s: float) -> int:
    lines, _ = run_and_kill("tests.segments_child", [str(directory), str(BOUND)], steps, delay_s)
    assert "done" not in lines, "the child finished before it was killed"
    return last_reported_step(lines)


@pytest.mark.slow
def test_sigkill_of_a_segmented_recording(tmp_path: Path) -> None:
    rng = random.Random(11)
    plans = [(tmp_path / f"run{i}", rng.randint(50, 1200), rng.random() * 0.003) for i in range(8)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        flushed = list(pool.map(lambda p: kill(*p), plans))
    rotated = 0
    for (directory, _, _), last_flushed in zip(plans, flushed, strict=True):
        segs = list_segments(directory)
        rotated += segs[-1].seq > 0
        assert sum(s.path.stat().st_size for s in segs) <= BOUND
        with open_trace(directory) as reader:
            assert isinstance(reader, SegmentedReader)
            assert not reader.closed_cleanly
            state: State | None = None
            last = reader.header.first_step - 1
            for entry in reader.entries():
                rec = entry.record
                if isinstance(rec, Snapshot):
                    if state is None:
                        state = State.from_snapshot(reader.header, rec)
                    else:
                        assert state.to_snapshot() == rec
                elif isinstance(rec, Step):
                    if state is None:
                        assert reader.header.first_step == 0
                        state = State.initial(reader.header)
                    apply(state, rec, entry.offset)
                    assert rec.step == last + 1
                    last = rec.step
            assert last >= last_flushed, (
                f"step {last_flushed} was flushed, the trace ends at {last}"
            )
        if state is not None:
            state.check_invariants()
    assert rotated >= 6  # most kills came after a rotation
    assert sum(f >= 0 for f in flushed) >= 6
