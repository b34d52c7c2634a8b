"""The app, driven by keys and clicks (Textual's Pilot) on a recorded trace. Each test
checks what the app holds and what the screen shows, against the Timeline's own answer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot

from recorder.reader import TraceReader
from recorder.schema import Status
from replays.breakpoints import find, parse
from replays.state import State
from replays.timeline import Timeline
from tests.tui_support import (
    app_test,
    at_step,
    fixed_trace,
    make_app,
    screen_text,
    submit,
    wait_until,
    widget_text,
)
from tui.app import FrameReady
from tui.screens.help import HelpScreen
from tui.widgets.blockmap import BlockMap
from tui.widgets.events import EventLog
from tui.widgets.header import StepHeader
from tui.widgets.requests import RequestTable
from tui.widgets.sparks import Sparklines, window

SIZE = (120, 40)
PREEMPT = parse("preempt")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixed_trace(tmp_path_factory.mktemp("tui"))


@pytest.fixture(scope="module")
def timeline(trace: Path) -> Iterator[Timeline]:
    with Timeline(TraceReader(trace)) as tl:
        yield tl


def header(app: object) -> str:
    """The first two lines of the screen."""
    return "\n".join(screen_text(app).splitlines()[:2])  # type: ignore[arg-type]


async def click_row(pilot: Pilot[None], request_id: str) -> None:
    """Scroll the request's row into view and click it."""
    table = pilot.app.query_one(RequestTable)
    row = table.index_of(request_id)
    table.scroll_to_row(row)
    await pilot.pause(0.02)
    await pilot.click(RequestTable, offset=(8, row - table.scroll_offset.y + 1))


@app_test
async def test_stepping_forwards_and_back(trace: Path, timeline: Timeline) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        assert f"step 0 / {timeline.last_step}" in header(app)
        assert app.frame is not None and app.frame.header.mode == "PAUSED"
        for keys, step in (
            (["right"], 1),
            (["shift+right"], 11),
            (["left"], 10),
            (["shift+right"] * 3, 40),
            (["shift+left"], 30),
            (["home"], 0),
            (["end"], timeline.last_step),
        ):
            await pilot.press(*keys)
            await at_step(pilot, step)
            state = timeline.state(step)
            frame = app.frame
            assert frame.header.running == len(state.running)
            assert frame.header.waiting == len(state.waiting)
            assert frame.header.free_blocks == len(state.free)
            assert {
                r.request_id
                for r in frame.requests
                if r.state in ("running", "waiting", "preempted")
            } == {r.request_id for r in state.requests.values()}
            text = header(app)
            assert f"step {step:,} / {timeline.last_step}" in text
            assert f"running {len(state.running)}/16" in text
            assert f"free {len(state.free)} / 95" in text
            assert map_glyphs(app) == expected_glyphs(state)


def map_glyphs(app: object) -> list[str]:
    """The block map's glyph for every block, read off the screen (two cells a block)."""
    blocks = app.query_one(BlockMap)  # type: ignore[attr-defined]
    g, label = blocks.geometry, blocks.label_width
    assert g.zoom == "wide"
    out = []
    for line in widget_text(blocks).splitlines()[: g.lines]:
        out += list(line[label : label + 2 * g.cols : 2])
    return out[: blocks.vm.num_blocks]


def expected_glyphs(state: State) -> list[str]:
    owners = state.block_owners()
    glyphs = ["╳"]
    for b in range(1, state.num_blocks):
        held = len(owners[b])
        glyphs.append("▓" if held > 1 else "█" if held else "▒" if b in state.block_hashes else "·")
    return glyphs


@app_test
async def test_go_to_a_step_a_move_and_a_time(trace: Path, timeline: Timeline) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        await pilot.press("g", *"120", "enter")
        await at_step(pilot, 120)
        assert "step 120 / " in header(app)
        await pilot.press("g", *"-15", "enter")
        await at_step(pilot, 105)
        t_ms = timeline.time_ns(50) / 1e6
        await pilot.press("g")
        await submit(pilot, f"{t_ms:.6f}ms")
        await at_step(pilot, timeline.step_at_time(int(t_ms * 1e6)))
        assert app.frame.header.step == 50
        await pilot.press("g")
        await submit(pilot, "soon")  # the dialog stays open, and says what is wrong
        await pilot.pause(0.05)
        assert "not a step" in screen_text(app)
        await pilot.press("escape")
        await pilot.pause(0.05)
        assert app.frame.header.step == 50


@app_test
async def test_the_preemption_breakpoint_lands_where_find_does(
    trace: Path, timeline: Timeline
) -> None:
    hits = []
    at = -1
    while (hit := find(timeline, [PREEMPT], at)) is not None:
        hits.append(hit)
        at = hit
    assert len(hits) >= 3, "the demo workload preempts several times"
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        await pilot.press("b")
        await wait_until(pilot, lambda: app.frame.header.breakpoints == ("preempt",))
        assert "● preempt" in header(app)
        for hit in hits:
            await pilot.press("n")
            await at_step(pilot, hit)
            text = screen_text(app)
            assert f"step {hit} / " in text
            assert f"breakpoint hit at step {hit}: preempt" in text
            assert "PREEMPT" in text
        log = app.query_one(EventLog)
        shown = log.events[-log.size.height :]
        row = next(i for i, e in enumerate(shown) if e.step < hits[-1])
        await pilot.click(EventLog, offset=(10, row))  # an event's line: its step
        await at_step(pilot, shown[row].step)
        sparks = app.query_one(Sparklines)
        vm = sparks.vm
        assert vm is not None
        lo, _ = window(len(vm.series[0].values), vm.cursor, sparks.size.width - 12 - 9)
        await pilot.click(Sparklines, offset=(12 + 3, 0))  # the history's fourth column
        await at_step(pilot, vm.first + lo + 3)
        await pilot.press("g", *str(hits[-1]), "enter")
        await at_step(pilot, hits[-1])
        await pilot.press("n")  # no later hit: it stays, and says so
        await wait_until(pilot, lambda: any("no breakpoint hit after" in t for _, t in app.notices))
        assert app.frame.header.step == hits[-1]
        for hit in reversed(hits[:-1]):
            await pilot.press("N")
            await at_step(pilot, hit)
            assert find(timeline, [PREEMPT], hit + 1, backward=True) == hit
        await pilot.press("b")
        await wait_until(pilot, lambda: app.frame.header.breakpoints == ())
        assert "● preempt" not in header(app)


@app_test
async def test_breakpoints_given_on_the_command_line_and_in_the_dialog(
    trace: Path, timeline: Timeline
) -> None:
    free = parse("free<10")
    app = make_app(trace, breakpoints=(free,))
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        await pilot.press("n")
        await at_step(pilot, find(timeline, [free], 0))
        await pilot.press("B")
        await pilot.pause(0.05)
        assert "free<10" in screen_text(app)  # the dialog starts with the breakpoints set
        await submit(pilot, "x, finish:req-09")  # a bad one: the dialog says so
        await pilot.pause(0.05)
        assert "unknown" in screen_text(app)
        await submit(pilot, "finish:req-09")
        await wait_until(pilot, lambda: app.frame.header.breakpoints == ("finish:req-09",))
        start = app.frame.header.step
        await pilot.press("n")
        await at_step(pilot, find(timeline, [parse("finish:req-09")], start))
        assert "req-09 finished" in screen_text(app)


@app_test
async def test_filtering_requests(trace: Path, timeline: Timeline) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"40", "enter")
        await at_step(pilot, 40)
        state = timeline.state(40)
        waiting = sorted(
            r.request_id for r in state.requests.values() if r.status == Status.WAITING
        )
        assert waiting and len(waiting) < len(state.requests)
        await pilot.press("slash", *"waiting", "enter")
        table = app.query_one(RequestTable)
        await wait_until(pilot, lambda: len(table.rows) == len(waiting))
        assert sorted(r.request_id for r in table.rows) == waiting
        text = screen_text(app)
        assert f"requests {len(waiting)} of {len(app.frame.requests)}" in text
        assert "filter: waiting" in text
        running = [r.request_id for r in state.requests.values() if r.status == Status.RUNNING]
        shown = widget_text(table)
        assert all(f" {rid} " not in shown for rid in running)
        assert all(f" {rid} " in shown for rid in waiting[:5])
        await pilot.press("escape")
        await wait_until(pilot, lambda: len(table.rows) == len(app.frame.requests))


@app_test
async def test_following_a_request_jumps_between_its_events(
    trace: Path, timeline: Timeline
) -> None:
    rid = "req-18"  # preempted in the demo, then resumed
    events = [parse(f"{k}:{rid}") for k in ("admit", "preempt", "first-token", "finish")]
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"10", "enter")
        await at_step(pilot, 10)
        await click_row(pilot, rid)
        await wait_until(pilot, lambda: app.selected_request == rid)
        await pilot.press("f")
        await wait_until(pilot, lambda: app.frame.header.followed == rid)
        assert f"following {rid}" in header(app)
        step = 10
        seen = []
        while (nxt := find(timeline, events, step)) is not None:
            await pilot.press("right_square_bracket")
            await at_step(pilot, nxt)
            seen.append(nxt)
            step = nxt
            assert f"{rid}: " in screen_text(app)
        assert len(seen) >= 3  # first token, preemption, resumption, finish
        back = find(timeline, events, step, backward=True)
        await pilot.press("left_square_bracket")
        await at_step(pilot, back)
        await pilot.press("f")
        await wait_until(pilot, lambda: app.frame.header.followed is None)


@app_test
async def test_selecting_a_block_names_its_owner(trace: Path, timeline: Timeline) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"30", "enter")
        await at_step(pilot, 30)
        owners = timeline.state(30).block_owners()
        ids = {ref: r.request_id for ref, r in timeline.state(30).requests.items()}
        blocks = app.query_one(BlockMap)
        label = blocks.label_width
        for block in (1, 7, 40):
            x, y = blocks.geometry.cell_of(block)
            await pilot.click(BlockMap, offset=(x + label, y))
            await wait_until(pilot, lambda b=block: app.selected_block == b)
            text = screen_text(app)
            assert f"block {block} " in text
            names = [ids[ref] for ref in owners[block]]
            if len(names) == 1:
                assert f"held by {names[0]}" in text
            elif names:
                assert f"shared by {', '.join(names[:3])}" in text
            else:
                assert "free" in text
        # Selecting a request lights up its blocks: the map knows which.
        ref = next(ref for ref in ids if timeline.state(30).requests[ref].block_ids)
        await click_row(pilot, ids[ref])
        await wait_until(pilot, lambda: blocks.highlight == ref)
        assert set(timeline.state(30).requests[ref].block_ids) <= blocks._hl_cells


@app_test
async def test_sorting_and_the_help_screen(trace: Path) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g", *"60", "enter")
        await at_step(pilot, 60)
        table = app.query_one(RequestTable)
        await pilot.press("s", "s", "s")  # arrival -> id -> state -> tokens
        await wait_until(pilot, lambda: app.sort_key == "tokens")
        computed = [r.computed for r in table.rows]
        assert computed == sorted(computed, reverse=True)  # a number: largest first
        assert "sorted by tokens ▼" in screen_text(app)
        await pilot.press("S")
        await wait_until(pilot, lambda: not app.sort_reverse)
        assert [r.computed for r in table.rows] == sorted(computed)
        await pilot.click(RequestTable, offset=(5, 0))  # the "request" title: by id
        await wait_until(pilot, lambda: app.sort_key == "id")
        ids = [r.request_id for r in table.rows]
        assert ids == sorted(ids)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = screen_text(app)
        assert "next / previous hit" in text and "zoom: 1, 2 per cell, aggregate" in text
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))


@app_test
async def test_playing_and_zooming(trace: Path, timeline: Timeline) -> None:
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        await pilot.press("space")  # 10 steps/s: still playing when press() returns
        await wait_until(pilot, lambda: app.frame.header.mode == "PLAYING")
        assert "PLAYING  10 steps/s" in header(app)
        await pilot.press("plus", "plus", "plus", "plus")  # 200 steps/s: to the end
        await wait_until(
            pilot,
            lambda: (
                app.frame.header.step == timeline.last_step and app.frame.header.mode == "PAUSED"
            ),
            timeout=30,
        )
        blocks = app.query_one(BlockMap)
        zooms = []
        assert blocks.geometry.zoom == "wide"  # 95 blocks fit at two cells each
        for _ in range(4):
            await pilot.press("z")
            await pilot.pause(0.02)
            zooms.append(blocks.geometry.zoom)
        assert zooms == ["block", "half", "fit", "wide"]
        assert "1 block per 2 cells" in screen_text(app)


@app_test
async def test_live_mode_picks_up_appended_records(tmp_path: Path, trace: Path) -> None:
    data = trace.read_bytes()
    with TraceReader(trace) as reader:
        offsets = reader.index().step_offsets
    growing = tmp_path / "growing.trace"
    growing.write_bytes(data[: offsets[20]])  # steps 0..19, whole records only
    app = make_app(growing, live=True)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 19)
        assert app.frame.header.mode == "LIVE"
        assert "step 19 / 19" in header(app)
        with open(growing, "ab") as f:
            f.write(data[offsets[20] : offsets[61] + 3])  # and a record cut mid-frame
        await at_step(pilot, 60)
        assert "step 60 / 60" in header(app) and "LIVE" in header(app)
        await pilot.press("left")  # stepping back stops following...
        await at_step(pilot, 59)
        with open(growing, "ab") as f:
            f.write(data[offsets[61] + 3 : offsets[90]])
        await wait_until(pilot, lambda: app.frame.header.last_step == 89)
        assert app.frame.header.step == 59 and app.frame.header.mode == "PAUSED"
        await pilot.press("F")  # ...and F follows again
        await at_step(pilot, 89)
        assert app.frame.header.mode == "LIVE"
        with open(growing, "ab") as f:
            f.write(data[offsets[90] :])  # the rest, footer and END included
        last = len(offsets) - 1
        await wait_until(pilot, lambda: app.frame.header.ended)
        await at_step(pilot, last)
        assert "trace ended" in header(app)


@app_test
async def test_a_cut_trace_says_where_in_the_app(tmp_path: Path, trace: Path) -> None:
    data = trace.read_bytes()
    with TraceReader(trace) as reader:
        cut_at = reader.index().step_offsets[30] + 11
    path = tmp_path / "cut.trace"
    path.write_bytes(data[:cut_at])
    app = make_app(path)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        await wait_until(pilot, lambda: bool(app.notices))
        severity, text = app.notices[0]
        assert severity == "warning"
        assert f"cut at byte {cut_at - 11:,}" in text and "ends at step 29" in text
        await pilot.press("end")
        await at_step(pilot, 29)


@app_test
async def test_a_frame_that_arrives_while_the_app_closes(trace: Path) -> None:
    """The reader thread may hand over a frame after the panes are gone (the app is
    closing): it is dropped, not a crash."""
    app = make_app(trace)
    async with app.run_test(size=SIZE) as pilot:
        await at_step(pilot, 0)
        assert app.frame is not None
        await app.query_one(StepHeader).remove()  # as when the app tears its screen down
        seq = app.frame.seq + 1
        with app.source._lock:
            app.source._frame = dataclasses.replace(app.frame, seq=seq)
        app.on_frame_ready(FrameReady())
        assert app.frame.seq == seq  # taken, and nothing raised
