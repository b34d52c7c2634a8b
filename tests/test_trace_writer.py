"""The writer: a slow disk holds the engine for one flush at most, and every record still
lands in order."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from recorder.codec import encode
from recorder.reader import TraceReader
from recorder.schema import Header, Step
from recorder.writer import SLOW_WRITE_S, TraceWriter

HEADER = Header("test", "", {}, 16, 64, "fcfs", 0, "host", False)


class FakeClock:
    """Time that passes only when the test's disk says so: a loaded machine's scheduling
    hiccups must not decide whether a write counts as slow."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_after_a_slow_write_flushes_no_longer_wait_for_the_disk(tmp_path: Path) -> None:
    gate = threading.Event()  # the disk hangs until the test opens it
    writers: list[str] = []
    clock = FakeClock()

    def write(fd: int, data: memoryview) -> int:
        writers.append(threading.current_thread().name)
        if len(writers) == 1:
            clock.now += SLOW_WRITE_S * 2  # the first (inline) write is slow...
        elif not gate.wait(timeout=30):  # ...and the disk then hangs
            raise OSError("the test's disk never came back")
        else:
            clock.now += SLOW_WRITE_S * 2  # (and it stays slow)
        return os.write(fd, data)

    path = tmp_path / "slow.trace"
    writer = TraceWriter(path, write=write, clock=clock)
    writer.append(*encode(HEADER), boundary=True)
    for step in range(200):  # all return although the disk is stuck: nothing waits on it
        writer.append(*encode(Step(step)), boundary=True)
    assert writers[0] == threading.current_thread().name
    assert not gate.is_set() and writer.flushed < writer.offset
    gate.set()
    writer.close()
    assert set(writers[1:]) == {"trace-flusher"}
    with TraceReader(path) as reader:
        assert [s.step for s in reader.steps()] == list(range(200))


def test_small_flushes_on_a_quick_disk_are_written_inline(tmp_path: Path) -> None:
    threads: list[str] = []

    def write(fd: int, data: memoryview) -> int:
        threads.append(threading.current_thread().name)
        return os.write(fd, data)

    writer = TraceWriter(tmp_path / "quick.trace", write=write, clock=FakeClock())
    writer.append(*encode(HEADER), boundary=True)
    for step in range(20):
        writer.append(*encode(Step(step)), boundary=True)
        assert writer.flushed == writer.offset  # readable at once, step by step
    writer.close()
    assert set(threads) == {threading.current_thread().name}


def test_batch_mode_buffers_until_the_size_bound(tmp_path: Path) -> None:
    writer = TraceWriter(
        tmp_path / "batch.trace",
        live=False,
        flush_bytes=2000,
        flush_interval_s=1e9,
        clock=FakeClock(),
    )
    writer.append(*encode(HEADER), boundary=True)
    sizes = []
    for step in range(300):
        writer.append(*encode(Step(step, token_budget=2048)), boundary=True)
        sizes.append(writer.flushed)  # small flushes are written inline: no race
    assert len(set(sizes)) < 60  # flushed in batches, not every step
    assert max(b - a for a, b in zip(sizes, sizes[1:])) >= 2000
    writer.close()
    with TraceReader(tmp_path / "batch.trace") as reader:
        assert len(list(reader.steps())) == 300 and reader.closed_cleanly is False
