"""Issue 28 item 3: following a live trace, the reader thread takes the new records in
batches (one per frame): each step is decoded and applied once, digested for the log in
order, and handed to the incident scans, which then need not read it again. These tests
grow a copy of a recorded trace batch by batch and check that nothing is lost or
reordered on the way, and that a view that falls too far behind says so."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from textual._compositor import Compositor
from textual.screen import Screen

from recorder.reader import TraceReader
from replays.queueing import QueueScan
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.tui_support import app_test, at_step, make_app
from tui import session as session_module
from tui import worker as worker_module
from tui.history import Event, History
from tui.incidents import IncidentFeed, IncidentsVM
from tui.session import Session
from tui.viewmodel import Frame
from tui.worker import BUSY_FRAME_S, FRAME_S, FrameSource, frame_spacing

INCIDENTS = Path(__file__).resolve().parent.parent / "replays" / "incidents"
STORM = INCIDENTS / "preemption_storm.trace"  # 586 steps, preemptions on most of them


class Growing:
    """A copy of `src` that grows by whole step records, as a live writer's file does."""

    def __init__(self, src: Path, dest: Path, first: int) -> None:
        self.data = src.read_bytes()
        with TraceReader(src) as reader:
            self.offsets = list(reader.index().step_offsets)
        self.dest = dest
        self.written = first
        dest.write_bytes(self.data[: self.offsets[first]])

    @property
    def steps(self) -> int:
        return len(self.offsets)

    def grow(self, n: int) -> None:
        """Append the next `n` step records (and, with the last, the end of the file)."""
        end = min(self.written + n, self.steps)
        stop = self.offsets[end] if end < self.steps else len(self.data)
        with open(self.dest, "ab") as f:
            f.write(self.data[self.offsets[self.written] : stop])
        self.written = end


def live(path: Path) -> tuple[Session, FrameSource]:
    s = Session(Timeline(open_reader(path), live=True), name=path.name, live=True)
    return s, FrameSource(s, lambda: None, lambda *_: None)


def events_of(history: History, lo: int, hi: int) -> list[Event]:
    out: list[Event] = []
    for step in range(lo, hi + 1):
        d = history.get(step)
        assert d is not None, f"step {step} was never digested"
        out.extend(d.events)
    return out


def unowned(e: Event) -> tuple[int, str, str]:
    """An event without whose cached blocks an eviction took ("(3 of s09)")."""
    return e.step, e.kind, re.sub(r" \(\d+ of [^)]*\)", "", e.text)


def reference(path: Path) -> tuple[list[Event], IncidentsVM]:
    """Every step's events and the incidents as a replay of the finished file finds them."""
    tl = Timeline(open_reader(path))
    history = History()
    history.prefix_caching = session_module.caches_prefixes(tl)  # as a Session's does
    history.fill(tl, tl.first_step, tl.last_step)
    feed = IncidentFeed(open_reader(path), live=False)
    while feed.busy:
        feed.step()
    return events_of(history, tl.first_step, tl.last_step), feed.view(tl.last_step)


def same_incidents(got: IncidentsVM, want: IncidentsVM) -> None:
    assert got.items == want.items
    assert got.summary == want.summary
    assert got.waits == want.waits
    assert got.head_of_line == want.head_of_line
    assert got.scanned_to == want.scanned_to and not got.error


@pytest.mark.parametrize("sizes", [(1,), (3, 17, 1, 64), (200,)])
def test_every_event_arrives_once_and_in_order_across_batches(
    tmp_path: Path, sizes: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    want_events, want_incidents = reference(STORM)
    # The waits' scan replays a step itself only when no batch handed it over; count how
    # often, to see that the batches did the work once.
    replayed = 0
    step = QueueScan._step

    def counted(self: QueueScan, *args: object) -> None:
        nonlocal replayed
        replayed += 1
        step(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(QueueScan, "_step", counted)
    g = Growing(STORM, tmp_path / "g.trace", 1)
    s, source = live(g.dest)
    frames: list[Frame] = []
    i = 0
    while True:
        frame = source.run_once()
        if frame is not None:
            frames.append(frame)
        if g.written == g.steps:
            break
        g.grow(sizes[i % len(sizes)])
        i += 1
    while (frame := source.run_once()) is not None or s.incidents.busy:
        frames.append(frame) if frame is not None else None
    last = frames[-1]
    assert last.header.step == g.steps - 1 and last.header.mode == "LIVE"
    assert all(a.header.step < b.header.step for a, b in zip(frames, frames[1:]))
    assert events_of(s.history, 0, g.steps - 1) == want_events
    assert not any("not read" in f.header.status for f in frames)
    if max(sizes) < 10:
        # Small batches: every frame's log holds all the events since the one before, so
        # the screen itself showed each event, in order, exactly once.
        shown: list[Event] = []
        for f in frames:
            cut = shown[-1].step if shown else -1
            shown.extend([e for e in f.events if e.step > cut])
        assert shown == [e for e in want_events if e.step >= frames[0].header.step]
    same_incidents(s.incidents.view(s.tl.last_step), want_incidents)
    # The first step is read by the scans themselves; the others came with the batches.
    assert replayed <= 2, f"{replayed} steps replayed twice"
    s.close()


def test_a_view_too_slow_skips_ahead_with_a_note_and_loses_no_incident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "CATCHUP", 64)
    want_events, want_incidents = reference(STORM)
    g = Growing(STORM, tmp_path / "g.trace", 10)
    s, source = live(g.dest)
    first = source.run_once()
    assert first is not None and first.header.step == 9
    g.grow(300)  # 300 new steps, more than the view digests one by one
    frame = source.run_once()
    assert frame is not None and frame.header.step == 309
    assert "236 steps not read: the engine writes faster than this view reads" in (
        frame.header.status
    )
    notes = [e for e in s.notes if e.kind == "note"]
    assert [(e.step, e.text.split(" steps")[0]) for e in notes] == [(246, "236")]
    assert s.history.get(245) is None and s.history.get(246) is not None
    # Back within reach: the next batch is digested whole, with no new note.
    g.grow(40)
    frame = source.run_once()
    assert frame is not None and frame.header.step == 349
    assert all(s.history.get(i) is not None for i in range(246, 350))
    assert len([e for e in s.notes if e.kind == "note"]) == 1
    # From the skip on, every step's events reached the log, in order, across the two
    # batches, as a replay of the whole file finds them; only whose cached blocks an
    # eviction took is not known for blocks cached in the steps skipped (said nowhere
    # rather than guessed).
    got = [unowned(e) for e in events_of(s.history, 246, 349)]
    assert got == [unowned(e) for e in want_events if 246 <= e.step <= 349]
    assert len(got) > 20
    # The incident scans read the skipped steps by themselves: the list misses nothing.
    g.grow(g.steps)
    while source.run_once() is not None or s.incidents.busy:
        pass
    same_incidents(s.incidents.view(s.tl.last_step), want_incidents)
    s.close()


def test_following_with_the_scans_caught_up_leaves_nothing_for_tick(tmp_path: Path) -> None:
    """While the frames hand the scans their steps, the worker has no scan slice to run
    between frames: it waits (for the poll), it does not spin."""
    g = Growing(STORM, tmp_path / "g.trace", 5)
    s, source = live(g.dest)
    while source.run_once() is not None or s.incidents.busy:
        pass
    g.grow(20)
    s.tick()  # the worker's tick before the next frame: the file grew
    assert s.incidents.busy  # there is more to scan ...
    assert s.timeout() == session_module.POLL_S  # ... but the next frame brings it
    frame = source.run_once()
    assert frame is not None and frame.header.step == 24
    assert s.incidents.scanned_to == 24 and not s.incidents.busy
    s.close()


def test_frames_come_half_as_often_while_reading_takes_most_of_the_time() -> None:
    """The drawing shares the interpreter with the reader: a frame whose batch took half
    the time between frames or more (an engine writing about as fast as the view reads)
    spaces the next one out, so that reading gets the time; a quick one does not."""
    assert frame_spacing(0.0) == FRAME_S
    assert frame_spacing(FRAME_S / 4) == FRAME_S
    assert frame_spacing(FRAME_S / 2) == BUSY_FRAME_S
    assert frame_spacing(1.0) == BUSY_FRAME_S
    assert FRAME_S < BUSY_FRAME_S <= 1 / 5  # still several frames a second


@app_test
async def test_a_live_frame_repaints_its_panes_and_lays_out_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame hands each pane its part, and the panes repaint themselves: the app's own
    attributes must not repaint the whole screen (an App's reactive does, by default),
    and a log or table that grows must not lay the screen out again (Textual's
    virtual_size does, on every change), or each frame would cost a full redraw."""
    g = Growing(STORM, tmp_path / "g.trace", 40)
    app = make_app(g.dest, live=True)
    layouts = full = 0
    layout, render_full = Screen._refresh_layout, Compositor.render_full_update

    def counted_layout(self: Screen[object], *args: Any, **kwargs: Any) -> None:
        nonlocal layouts
        layouts += 1
        layout(self, *args, **kwargs)

    def counted_full(self: Compositor, *args: Any, **kwargs: Any) -> Any:
        nonlocal full
        full += 1
        return render_full(self, *args, **kwargs)

    async with app.run_test(size=(160, 50)) as pilot:
        await at_step(pilot, 39)
        g.grow(60)  # the log and its scrollbar fill up
        await at_step(pilot, 99)
        monkeypatch.setattr(Screen, "_refresh_layout", counted_layout)
        monkeypatch.setattr(Compositor, "render_full_update", counted_full)
        for _ in range(5):
            before = app.frame
            g.grow(20)
            await at_step(pilot, g.written - 1)
            assert app.frame is not before
    assert (layouts, full) == (0, 0)


def test_the_worker_spaces_frames_by_how_long_the_last_one_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However fast the trace grows, frames that time alone makes due come FRAME_S apart
    at least, and BUSY_FRAME_S apart after one that took half of FRAME_S or more to build.
    The session's frames are made to "take" a set time by moving the worker's clock on
    (the waits between frames are real ones)."""
    g = Growing(STORM, tmp_path / "g.trace", 5)
    s, _ = live(g.dest)
    offset = 0.0
    real = time.monotonic
    clock = SimpleNamespace(monotonic=lambda: real() + offset)
    monkeypatch.setattr(worker_module, "time", clock)  # the worker's clock alone
    builds = iter([0.0, 0.0, 0.0, FRAME_S, FRAME_S, 0.0, 0.0] + [0.0] * 100)
    published: list[tuple[float, float]] = []  # (when the frame began, how long it took)
    done = threading.Event()
    frame = Session.frame

    def timed(self: Session) -> Frame:
        nonlocal offset
        began = clock.monotonic()
        took = next(builds)
        offset += took
        published.append((began, took))
        if len(published) == 7:
            done.set()
        return frame(self)

    monkeypatch.setattr(Session, "frame", timed)
    taken = threading.Event()
    source = FrameSource(s, taken.set, lambda *_: None)
    thread = threading.Thread(target=source.run)
    thread.start()
    try:
        for _ in range(100):
            if done.is_set():
                break
            g.grow(3)  # every frame finds new steps: each is due by time alone
            taken.wait(5)
            taken.clear()
            source.take()
    finally:
        source.stop()
        thread.join(10)
    assert done.is_set() and not thread.is_alive()
    gaps = [
        (b - a, took) for (a, took), (b, _) in zip(published[1:], published[2:7])
    ]  # after the first frame (asked for at once)
    for gap, took in gaps:
        assert gap >= frame_spacing(took) - 1e-6, (gap, took)
    assert [frame_spacing(t) for _, t in gaps] == [
        FRAME_S,
        FRAME_S,
        BUSY_FRAME_S,
        BUSY_FRAME_S,
        FRAME_S,
    ]
    s.close()
