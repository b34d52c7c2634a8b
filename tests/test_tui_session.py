"""The TUI's plain-Python core, with no app: the view-model reducer, the session's
commands and ticks (on a fake clock), the bounded history, and the coalescing worker."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import tui.session as session_module
from recorder.reader import TraceReader
from recorder.schema import Reason
from replays.breakpoints import find, parse
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.tui_support import demo_workload, fixed_trace
from tui.commands import FindBreak, Goto, Move, Speed, ToggleBreakpoint, TogglePlay
from tui.history import History
from tui.session import Session
from tui.viewmodel import (
    CACHED,
    FREE,
    REASONS,
    SHARED,
    USED,
    Frame,
    block_info,
    build_frame,
    table_rows,
)
from tui.worker import FrameSource

PREEMPT = parse("preempt")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixed_trace(tmp_path_factory.mktemp("core"))


def session(path: Path, **kw: object) -> Session:
    return Session(Timeline(open_reader(path)), name=path.name, **kw)  # type: ignore[arg-type]


def settled(s: Session) -> Frame:
    """The frame once the history after a jump is made (it comes a tick after the step)."""
    frame = s.frame()
    while s.dirty or s.timeout() == 0:
        s.tick()
        frame = s.frame()
    return frame


def test_a_jump_shows_the_step_first_and_its_history_a_frame_later(trace: Path) -> None:
    s = session(trace)
    s.handle(Goto(120))
    first = s.frame()
    assert first.header.step == 120 and len(first.sparks.series[0].values) == 1  # its own
    assert s.timeout() == 0  # more to do at once
    s.tick()
    assert s.dirty
    second = s.frame()
    assert second.header.step == 120 and len(second.sparks.series[0].values) == 160
    assert second.events and first.requests == second.requests
    s.handle(Move(1))
    third = s.frame()  # a step forwards: the history is there already
    assert len(third.sparks.series[0].values) == 160 and not s.dirty


def test_frames_agree_with_the_timeline_at_every_step(trace: Path) -> None:
    s = session(trace)
    tl = Timeline(open_reader(trace))
    for step in range(0, tl.num_steps, 7):
        s.handle(Goto(step))
        frame = s.frame()
        state = tl.state(step)
        assert frame.header.step == step
        live = {
            r.request_id: r
            for r in frame.requests
            if r.state in ("waiting", "running", "preempted")
        }
        assert set(live) == {r.request_id for r in state.requests.values()}
        for r in state.requests.values():
            row = live[r.request_id]
            assert (row.computed, row.blocks, row.preemptions) == (
                r.num_computed_tokens,
                len(r.block_ids),
                r.num_preemptions,
            )
        owners = state.block_owners()
        for b in range(1, state.num_blocks):
            cls = frame.blocks.cls[b]
            if not owners[b]:
                assert cls == (CACHED if b in state.block_hashes else FREE)
            else:
                assert cls == (SHARED if len(owners[b]) > 1 else USED)
                assert frame.blocks.owner[b] == owners[b][0]
        rec = tl.record(step)
        assert frame.batch.budget == rec.token_budget
        assert sum(e.tokens for e in frame.batch.entries) == rec.num_scheduled_tokens
        finished = {
            r.request_id
            for r in frame.requests
            if r.state in ("stopped", "length", "aborted", "error")
        }
        assert len(finished) == len(rec.finishes)


def test_the_reducer_is_pure(trace: Path) -> None:
    tl = Timeline(open_reader(trace))
    s = session(trace)
    s.handle(Goto(40))
    first = s.frame()
    before = tl.state(40).to_snapshot()
    again = build_frame(tl.state(40), None, (), (), (), _ctx(first))
    assert tl.state(40).to_snapshot() == before  # the state is read, never changed
    assert again == build_frame(tl.state(40), None, (), (), (), _ctx(first))
    with pytest.raises(AttributeError):
        first.header.step = 3  # type: ignore[misc]


def _ctx(frame: Frame):  # type: ignore[no-untyped-def]
    from tui.viewmodel import Context

    h = frame.header
    return Context(
        h.step,
        h.trace,
        h.first_step,
        h.last_step,
        h.max_num_seqs,
        h.mode,
        h.speed,
        h.breakpoints,
        h.followed,
        h.live,
        h.ended,
        h.idle_s,
        h.search_at,
    )


def test_why_a_request_waits_comes_from_the_step_record(trace: Path) -> None:
    tl = Timeline(open_reader(trace))
    s = session(trace)
    checked = 0
    for step in range(tl.num_steps):
        rec = tl.record(step)
        stop = rec.waiting_stop
        if stop is None or stop.head == Reason.PREEMPTION or rec.preemptions:
            continue
        s.handle(Goto(step))
        frame = s.frame()
        waiting = [tl.state(step).requests[ref].request_id for ref in tl.state(step).waiting]
        why = {r.request_id: r.why for r in frame.requests}
        assert why[waiting[0]] == REASONS[stop.head]
        assert all(why[rid] == REASONS[stop.rest] for rid in waiting[1:])
        checked += 1
    assert checked >= 3


def test_a_preempted_request_says_for_whom(trace: Path) -> None:
    tl = Timeline(open_reader(trace))
    step = find(tl, [PREEMPT], -1)
    assert step is not None
    p = tl.record(step).preemptions[0]
    s = session(trace)
    s.handle(Goto(step))
    frame = settled(s)
    names = {r.ref: r.request_id for r in frame.requests}
    victim = next(r for r in frame.requests if r.ref == p.victim)
    assert victim.state == "preempted"
    assert victim.why == f"preempted for {names[p.for_request]}"
    assert any(e.kind == "preempt" and names[p.victim] in e.text for e in frame.events)


def test_filtering_and_sorting_rows(trace: Path) -> None:
    s = session(trace)
    s.handle(Goto(40))
    rows = s.frame().requests
    waiting = table_rows(rows, "waiting")
    assert waiting and all(r.state == "waiting" for r in waiting)
    assert table_rows(rows, "req-1 running") == tuple(
        r for r in rows if "req-1" in r.request_id and r.state == "running"
    )
    by_blocks = table_rows(rows, sort="blocks", reverse=True)
    assert [r.blocks for r in by_blocks] == sorted((r.blocks for r in rows), reverse=True)
    assert table_rows(rows, "no-such-request") == ()


def test_block_info_names_owners_hash_and_tokens(trace: Path) -> None:
    tl = Timeline(open_reader(trace))
    s = session(trace)
    s.handle(Goto(30))
    frame = s.frame()
    state = tl.state(30)
    shared = next(b for b, o in enumerate(state.block_owners()) if len(o) > 1)
    info = block_info(frame, shared)
    assert info is not None and info.cls == SHARED
    owners = state.block_owners()[shared]
    assert info.owners == tuple(state.requests[r].request_id for r in owners)
    assert info.ref_cnt == state.ref_cnts[shared] == len(owners)
    assert info.hash == state.block_hashes[shared]
    first = state.requests[owners[0]]
    i = first.block_ids.index(shared)
    assert info.tokens == (i * 16, (i + 1) * 16)
    free = next(iter(state.free))
    assert block_info(frame, free).free_rank == 0  # type: ignore[union-attr]


def test_playing_follows_the_clock_and_stops_at_a_breakpoint(trace: Path) -> None:
    clock = Clock()
    tl = Timeline(open_reader(trace))
    s = Session(tl, name="t", clock=clock)
    s.handle(TogglePlay())
    assert s.mode == "PLAYING"
    clock.t += 0.55  # 10 steps/s
    s.tick()
    assert s.cursor == 5
    s.handle(Speed(True))  # 20 steps/s
    s.handle(ToggleBreakpoint(PREEMPT))
    hit = find(tl, [PREEMPT], 5)
    assert hit is not None
    for _ in range(100):
        clock.t += 0.05
        s.tick()
        if not s.playing:
            break
    assert s.cursor == hit and s.mode == "PAUSED"
    assert s.notes[-1].text == f"breakpoint hit at step {hit}: preempt"
    s.handle(Goto(tl.last_step - 1))
    s.handle(TogglePlay())
    clock.t += 10
    s.tick()
    assert s.cursor == tl.last_step and not s.playing


def test_a_long_search_runs_in_slices(trace: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(session_module, "SLICE", 4)
    tl = Timeline(open_reader(trace))
    s = Session(tl, name="t", breakpoints=(parse("finish:req-07"),))
    want = find(tl, [parse("finish:req-07")], 0)
    assert want is not None and want > 40
    s.handle(FindBreak(False))
    ticks = 0
    while s.search is not None:
        assert s.mode == "SEARCHING" and s.timeout() == 0
        s.tick()
        ticks += 1
    assert s.cursor == want and ticks >= want // 4 - 1
    s.handle(FindBreak(True))
    while s.search is not None:
        s.tick()
    assert s.cursor == want  # no earlier hit: it stays
    assert any("no breakpoint hit before" in text for _, text in s.notices)


def test_history_stays_bounded(trace: Path) -> None:
    tl = Timeline(open_reader(trace))
    history = History(capacity=32)
    history.fill(tl, 0, tl.last_step)
    assert len(history) == 32
    assert [d.step for d in history.window(0, tl.last_step)] == list(
        range(tl.last_step - 31, tl.last_step + 1)
    )
    assert sum(d.preemptions for d in History(1000).window(0, 10)) == 0


def test_live_frames_are_coalesced_to_the_newest_step(trace: Path, tmp_path: Path) -> None:
    data = trace.read_bytes()
    with TraceReader(trace) as reader:
        offsets = reader.index().step_offsets
    growing = tmp_path / "g.trace"
    growing.write_bytes(data[: offsets[10]])
    clock = Clock()
    s = Session(
        Timeline(open_reader(growing), live=True),
        name="g",
        live=True,
        clock=clock,
        history=History(capacity=64),
    )
    frames: list[Frame] = []
    source = FrameSource(s, lambda: None, lambda *_: None)
    frame = source.run_once()
    assert frame is not None and frame.header.step == 9 and frame.header.mode == "LIVE"
    with open(growing, "ab") as f:
        f.write(data[offsets[10] : offsets[150]])  # 140 steps at once
    frame = source.run_once()
    assert frame is not None and frame.header.step == 149  # one frame, for the newest
    frames.append(frame)
    assert source.run_once() is None  # nothing new: no frame
    assert len(s.history) <= 64
    fresh = History(capacity=64)
    fresh.engine_time = s.history.engine_time  # a simulated trace: the engine's own step time
    fresh.prefix_caching = s.history.prefix_caching  # admissions say hit or miss
    fresh.fill(Timeline(open_reader(trace)), 149 - 63, 149)
    assert fresh.window(0, 149) == s.history.window(0, 149)  # following misses no step
    assert frame.events[-1].step <= 149 and frame.events[0].step >= 149 - 64
    s.handle(Move(-5))
    assert source.run_once().header.mode == "PAUSED"  # type: ignore[union-attr]
    clock.t += 5
    frame = source.run_once()
    assert frame is not None and frame.header.idle_s == 5  # the header says it is quiet


def test_the_worker_thread_hands_over_frames_and_stops(trace: Path) -> None:
    ready = threading.Event()
    s = session(trace)
    source = FrameSource(s, ready.set, lambda *_: None)
    thread = threading.Thread(target=source.run)
    thread.start()
    try:
        assert ready.wait(10)
        ready.clear()
        assert source.take().header.step == 0  # type: ignore[union-attr]
        for _ in range(20):
            source.send(Move(1))  # faster than frames are taken: coalesced
        assert ready.wait(10)
        frame = source.take()
        while frame is None or frame.header.step != 20:
            assert ready.wait(10)
            ready.clear()
            frame = source.take() or frame
        assert frame.header.step == 20
    finally:
        source.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_an_unreadable_step_is_a_notice_not_a_crash(trace: Path, tmp_path: Path) -> None:
    data = bytearray(trace.read_bytes())
    with TraceReader(trace) as reader:
        offset = reader.index().step_offsets[100]
    data[offset + 12] ^= 0xFF  # the index is in the footer: the damage shows on reading
    bad = tmp_path / "bad.trace"
    bad.write_bytes(bytes(data))
    notices: list[tuple[str, str]] = []
    s = Session(Timeline(open_reader(bad)), name="bad", history=History(capacity=8))
    source = FrameSource(s, lambda: None, lambda sev, text: notices.append((sev, text)))
    assert source.run_once().header.step == 0  # type: ignore[union-attr]
    s.handle(Goto(120))
    assert source.run_once() is None
    assert notices and notices[-1][0] == "error" and f"at byte {offset}" in notices[-1][1]
    assert s.cursor == 0  # back where it could show
    s.handle(Goto(50))
    assert source.run_once().header.step == 50  # type: ignore[union-attr]


def test_a_trace_with_no_steps(tmp_path: Path) -> None:
    w = demo_workload()
    path = fixed_trace(tmp_path, w)
    with TraceReader(path) as reader:
        first = reader.index().step_offsets[0]
    empty = tmp_path / "empty.trace"
    empty.write_bytes(path.read_bytes()[:first])
    s = Session(Timeline(open_reader(empty), live=True), name="e", live=True)
    frame = s.frame()
    assert frame.header.step == -1 and frame.requests == () and frame.batch.entries == ()
    assert frame.blocks.cls.count(FREE) == 95


def test_live_waits_for_a_header_being_written(trace: Path, tmp_path: Path) -> None:
    """`schedtop live` right after an engine started: the file is there, its header not
    yet whole. A missing file is an error at once (test_tui_cli)."""
    from tui.launch import open_session

    data = trace.read_bytes()
    path = tmp_path / "starting.trace"
    path.write_bytes(data[:20])
    done = threading.Event()

    def finish_header() -> None:
        with TraceReader(trace) as reader:
            first = reader.index().step_offsets[0]
        time_to_wait = threading.Event()
        time_to_wait.wait(0.3)
        path.write_bytes(data[:first])
        done.set()

    writer = threading.Thread(target=finish_header)
    writer.start()
    s = open_session(path, live=True)
    writer.join()
    assert done.is_set() and s.frame().header.step == -1 and s.live
    s.close()
