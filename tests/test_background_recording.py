"""Recording in the background (RecorderOptions(background=True), as recorder.vllm records):
the engine's thread builds the records, a thread of the recorder's own encodes and
appends them, in order. The file must be the one the engine's thread would have
written. (A full disk: test_recorder.)"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.sim.api import demo_workload_path
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import load_workload
from recorder.background import Background
from recorder.codec import encode
from recorder.convert import StepCompactor
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions
from recorder.schema import End, Footer, Snapshot, Step
from recorder.writer import MemoryWriter, TraceWriter
from tests.helpers import record


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def running(t: threading.Thread, fn: Callable[..., Any]) -> bool:
    """Whether thread `t` is inside `fn` now."""
    frame = sys._current_frames().get(t.ident or -1)
    while frame is not None:
        if frame.f_code is fn.__code__:
            return True
        frame = frame.f_back
    return False


def masked(path: Path) -> list[bytes]:
    """The trace's records with what timing changes (times, and so offsets) zeroed."""
    out = []
    with TraceReader(path) as reader:
        out.append(encode(dataclasses.replace(reader.header, start_time_ns=0))[1])
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Step):
                rec = dataclasses.replace(
                    rec, time_ns=0, schedule_ns=0, update_ns=0, timings=(), work_ns=0
                )
            elif isinstance(rec, Footer):
                rec = dataclasses.replace(rec, step_offsets=(), snapshot_offsets=(), end_time_ns=0)
            elif isinstance(rec, End):
                rec = End(0)
            out.append(encode(rec)[1])
    return out


def check_index(path: Path) -> int:
    """The footer indexes every step and snapshot record where it is; returns the steps."""
    with TraceReader(path) as reader:
        entries = list(reader.entries())
        footer = reader.footer
    assert footer is not None and reader.closed_cleanly
    steps = [(e.offset, e.record.step) for e in entries if isinstance(e.record, Step)]
    snaps = [(e.offset, e.record.step) for e in entries if isinstance(e.record, Snapshot)]
    assert footer.step_offsets == tuple(o for o, _ in steps)
    assert [s for _, s in steps] == list(range(footer.first_step, footer.first_step + len(steps)))
    assert footer.snapshot_offsets == tuple(o for o, _ in snaps)
    assert footer.snapshot_steps == tuple(s for _, s in snaps)
    return len(steps)


def test_a_background_recording_is_the_trace_the_engine_thread_writes(tmp_path: Path) -> None:
    w = load_workload(demo_workload_path())
    paths = {}
    for background in (False, True):
        path = paths[background] = tmp_path / f"{background}.trace"
        run = record(w, TraceWriter(path, live=False), snapshot_interval=32, background=background)
        assert run.recorder.error is None
        assert (run.recorder.background_thread is not None) is background
    assert masked(paths[True]) == masked(paths[False])
    assert check_index(paths[True]) == check_index(paths[False]) > 100


def steady_fields(step: Step) -> list[Any]:
    return [
        step.step,
        step.schedule_ns,
        step.update_ns,
        step.token_budget,
        step.num_decodes,
        step.sample_counts,
        step.sampled_tokens,
        step.kv_events,
        step.free_blocks_after_schedule,
        step.free_blocks,
        step.work_ns,
    ]


def record_steady(path: Path, background: bool) -> int:
    """The demo, its steady decode steps reported compact (as recorder.vllm does), the
    others in full; returns how many went the steady way."""
    w = load_workload(demo_workload_path())
    engine = make_engine(w)
    probe = StepCompactor(w.config.policy, False)
    recorder = Recorder(
        engine,
        TraceWriter(path, live=False),
        RecorderOptions(background=background, snapshot_interval=40),
        install=False,
    )
    taken = 0
    for result in run_steps(w, engine):
        rep = result.report
        steady = probe._steady(rep, rep.step)
        if steady is None:
            probe.general(rep, rep.step)
            recorder.on_step(rep)
        else:
            recorder.on_steady_step(*steady_fields(steady))
            taken += 1
    recorder.close()
    assert recorder.error is None
    return taken


def test_steady_steps_recorded_in_the_background_make_the_same_trace(tmp_path: Path) -> None:
    fg, bg = tmp_path / "fg.trace", tmp_path / "bg.trace"
    assert record_steady(fg, False) == record_steady(bg, True) > 20
    assert masked(bg) == masked(fg)
    check_index(bg)


def test_flush_reaches_the_file_without_waiting_and_drain_waits(tmp_path: Path) -> None:
    w = load_workload(demo_workload_path())
    engine = make_engine(w)
    writer = TraceWriter(
        tmp_path / "t.trace", live=False, flush_bytes=1 << 30, flush_interval_s=1e9
    )
    recorder = Recorder(engine, writer, RecorderOptions(background=True))
    steps = run_steps(w, engine)
    for _ in range(5):
        next(steps)
    assert recorder.flushed_step == -1  # queued or buffered: nothing in the file yet
    recorder.flush()  # queued behind the five steps; the thread is woken
    recorder.drain()
    writer.drain()
    assert recorder.flushed_step == 4
    for _ in steps:
        pass
    engine.close()
    assert check_index(tmp_path / "t.trace") > 100


def test_strict_recording_is_not_done_in_the_background() -> None:
    w = load_workload(demo_workload_path())
    with pytest.raises(ValueError, match="strict"):
        Recorder(make_engine(w), MemoryWriter(), RecorderOptions(strict=True, background=True))


def test_background_runs_jobs_in_order_and_bounds_the_queue() -> None:
    bg = Background(name="test-jobs", max_queued=8)
    gate = threading.Event()
    done: list[int] = []

    def job(i: int) -> None:
        gate.wait()
        done.append(i)

    for i in range(7):
        bg.put(job, i)
    assert bg.pending == 7 and not done  # fewer than WAKE_EVERY: nobody was woken

    most: list[int] = []

    def more() -> None:
        for i in range(7, 40):
            bg.put(job, i)
            most.append(bg.pending)

    t = threading.Thread(target=more)
    t.start()
    # The eighth put waits for the queue to drain: wait until the thread is in drain()
    # (not a sleep, after which it may not have run at all), then check it never returned.
    wait_until(lambda: running(t, Background.drain), "the eighth put draining")
    assert bg.pending == bg.max_queued and most == []
    gate.set()
    t.join(5)
    assert not t.is_alive()
    bg.close()
    assert done == list(range(40))
    assert len(most) == 33 and max(most) < bg.max_queued
    bg.close()  # idempotent


def test_a_job_that_raises_is_logged_and_the_rest_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bg = Background(name="test-jobs")
    done: list[int] = []

    def bad() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="schedtop.recorder"):
        bg.put(bad)
        bg.put(done.append, 1)
        bg.drain()
    assert done == [1] and bg.pending == 0
    assert "a trace encoding job failed" in caplog.text and "boom" in caplog.text
    bg.close()
