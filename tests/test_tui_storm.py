"""Issue 15 in the app, driven with Pilot on the incident traces: the incidents view and
its jump, wait accounting, watchpoints, the event log, the 80x24 layout and the fixes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from textual import events

from recorder.reader import TraceReader
from replays.breakpoints import parse
from replays.storms import scan
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.tui_support import app_test, at_step, make_app, screen_text, wait_until, widget_text
from tui.commands import Goto, SetBreakpoints, TogglePlay
from tui.screens.help import HelpScreen
from tui.screens.incidents import IncidentsScreen
from tui.session import Session, Writer
from tui.widgets.blockmap import BlockMap
from tui.widgets.events import EventLog
from tui.widgets.incidents import IncidentTable
from tui.widgets.requests import RequestTable
from tui.widgets.sparks import Sparklines
from tui.worker import FrameSource

INCIDENTS = Path(__file__).resolve().parent.parent / "replays" / "incidents"
STORM = INCIDENTS / "preemption_storm.trace"
SMALL = (80, 24)
BIG = (120, 40)


async def open_incidents(pilot) -> IncidentsScreen:  # type: ignore[no-untyped-def]
    await pilot.press("i")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, IncidentsScreen))
    screen = pilot.app.screen
    assert isinstance(screen, IncidentsScreen)
    await wait_until(pilot, lambda: screen.vm is not None and screen.vm.done)
    return screen


@app_test
async def test_incidents_view_lists_every_preemption_and_enter_jumps() -> None:
    expected = scan(str(STORM)).incidents
    app = make_app(STORM)
    async with app.run_test(size=SMALL) as pilot:
        await at_step(pilot, 0)
        screen = await open_incidents(pilot)
        table = screen.query_one(IncidentTable)
        await wait_until(pilot, lambda: len(table.rows) == 25)
        assert table.rows == tuple(expected)
        text = screen_text(app)
        assert "25 preemptions in 586 steps" in text
        assert "s15" in text and "itself" in text
        # Down three rows, then enter: the fourth preemption's step, its victim selected.
        await pilot.press("j", "j", "j", "enter")
        fourth = expected[3]
        await at_step(pilot, fourth.step)
        assert not isinstance(app.screen, IncidentsScreen)
        assert app.selected_request == fourth.request_id
        assert f"preempted for {fourth.cause}" in screen_text(app)


@app_test
async def test_incidents_sort_filter_and_failures() -> None:
    app = make_app(INCIDENTS / "watermark_off.trace")
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        screen = await open_incidents(pilot)
        table = screen.query_one(IncidentTable)
        await wait_until(pilot, lambda: len(table.rows) == 10)
        await pilot.press("t")  # thrash only
        await wait_until(pilot, lambda: len(table.rows) == 3)
        assert all(i.thrash for i in table.rows)
        await pilot.press("t", "s")  # every one, sorted by request
        await pilot.press("s")  # by tokens lost: largest first on the first press
        await wait_until(pilot, lambda: screen.sort_key == "lost")
        lost = [i.tokens_lost for i in table.rows]
        assert lost == sorted(lost, reverse=True) and screen.sort_reverse
        assert "lost ▼" in screen_text(app)
        await pilot.press("slash", *"w04", "enter")
        w04 = [
            i
            for i in scan(str(INCIDENTS / "watermark_off.trace")).incidents
            if "w04" in (i.request_id, i.cause)
        ]
        await wait_until(pilot, lambda: sorted(table.rows, key=lambda i: i.step) == w04)
        await pilot.press("escape")  # clears the filter
        await wait_until(pilot, lambda: len(table.rows) == 10)
        await pilot.press("e")
        await wait_until(pilot, lambda: table.rows == ())
        assert "0 aborts and errors" in screen_text(app)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, IncidentsScreen))


@app_test
async def test_key_repeat_moves_one_row_per_press() -> None:
    app = make_app(STORM)
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        await pilot.press("shift+right")
        await at_step(pilot, 10)
        table = app.query_one(RequestTable)
        await wait_until(pilot, lambda: len(table.rows) >= 8)
        await pilot.press("j")
        await wait_until(pilot, lambda: app.selected_request is not None)
        start = table.index_of(app.selected_request)
        # Six presses that arrive together, as a terminal's key repeat delivers them: all
        # six are queued before the app has answered the first.
        for _ in range(6):
            app.post_message(events.Key("j", "j"))
        await wait_until(pilot, lambda: table.index_of(app.selected_request) == start + 6)


# -- 3. watchpoints, live breakpoints, unknown requests --------------------------------------


def growing_copy(src: Path, dest: Path, steps: int) -> tuple[bytes, list[int]]:
    """`dest`: the first `steps` step records of `src` (a trace still being written)."""
    data = src.read_bytes()
    with TraceReader(src) as reader:
        offsets = list(reader.index().step_offsets)
    dest.write_bytes(data[: offsets[steps]])
    return data, offsets


def live_session(path: Path, **kw: object) -> Session:
    return Session(Timeline(open_reader(path), live=True), name=path.name, live=True, **kw)  # type: ignore[arg-type]


def test_a_live_view_pauses_at_a_breakpoint_hit(tmp_path: Path) -> None:
    growing = tmp_path / "g.trace"
    data, offsets = growing_copy(STORM, growing, 3)  # the first preemption is at step 4
    s = live_session(growing, breakpoints=(parse("preempt"),))
    source = FrameSource(s, lambda: None, lambda *_: None)
    frame = source.run_once()
    assert frame is not None and frame.header.mode == "LIVE" and frame.header.step == 2
    with open(growing, "ab") as f:
        f.write(data[offsets[3] : offsets[30]])
    notices: list[tuple[str, str]] = []
    source = FrameSource(s, lambda: None, lambda *n: notices.append(n))
    frame = source.run_once()
    assert frame is not None and frame.header.step == 4 and frame.header.mode == "PAUSED"
    assert any("paused at a breakpoint hit, step 4" in text for _, text in notices)
    assert "breakpoint hit at step 4" in frame.header.status
    # Space resumes following the engine (not playing back at 10 steps/s).
    s.handle(TogglePlay())
    frame = source.run_once()
    assert frame is not None and frame.header.mode == "LIVE" and frame.header.step == 29


def test_a_breakpoint_on_an_unknown_request_is_refused() -> None:
    s = Session(Timeline(open_reader(STORM)), name="storm")
    notices: list[tuple[str, str]] = []
    source = FrameSource(s, lambda: None, lambda *n: notices.append(n))
    while s.incidents.busy:
        s.tick()
    s.handle(SetBreakpoints((parse("admit:s03"), parse("admit:nobody"))))
    frame = source.run_once()
    assert frame is not None and frame.header.breakpoints == ("admit:s03",)
    assert any("no request 'nobody'" in text for _, text in notices)
    # Given on the command line (replay --break): refused once the scan has read the trace.
    s = Session(Timeline(open_reader(STORM)), name="storm", breakpoints=(parse("admit:x"),))
    while s.incidents.busy:
        s.tick()
    assert s.breakpoints == [] and any("no request 'x'" in t for _, t in s.notices)
    out = subprocess.run(
        [sys.executable, "-m", "tui.cli", "find", str(STORM), "finish:nobody"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "no request 'nobody'" in out.stderr


@app_test
async def test_watchpoint_n_stops_once_per_transition() -> None:
    tl = Timeline(open_reader(STORM))
    below = [s for s in range(tl.last_step + 1) if tl.record(s).free_blocks < 2]
    drops = [s for s in below if s == 0 or tl.record(s - 1).free_blocks >= 2]
    assert len(drops) >= 2 and len(below) > len(drops)
    app = make_app(STORM, breakpoints=(parse("free<2"),))
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        for step in drops[:3]:
            await pilot.press("n")
            await at_step(pilot, step)
            assert f"breakpoint hit at step {step}: free<2" in screen_text(app)


# -- 2. wait accounting ------------------------------------------------------------------------


def last_scheduled(tl: Timeline, rid: str, step: int) -> int:
    """Brute force: the last step up to `step` that scheduled request `rid`."""
    for s in range(step, tl.first_step - 1, -1):
        view = tl.view(s)
        if any(view.names.get(e.ref) == rid for e in view.scheduled):
            return s
    return -1


@app_test
async def test_wait_goes_on_across_a_preemption() -> None:
    tl = Timeline(open_reader(STORM))
    # s12 is preempted at step 19 (the README) and still waits at step 40.
    assert any(
        tl.state(18).requests[p.victim].request_id == "s12" for p in tl.record(19).preemptions
    )
    since = last_scheduled(tl, "s12", 40)
    assert since < 19
    app = make_app(STORM)
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        await pilot.press("g", *"40", "enter")
        await at_step(pilot, 40)
        app.selected_request = "s12"
        await wait_until(
            pilot, lambda: row(app, "s12").wait is not None and row(app, "s12").wait_exact
        )
        r = row(app, "s12")
        assert r.wait == 40 - since  # counted from its last scheduled step, not its preemption
        counts = [int(part.split()[0]) for part in r.wait_why.split(", ")]
        assert sum(counts) == r.wait and "preempted" in r.wait_why and "no free KV" in r.wait_why
        await wait_until(pilot, lambda: f"s12 waited {r.wait} steps" in screen_text(app))
        # The queue head and what blocks it.
        state = tl.state(40)
        head = state.requests[state.waiting[0]]
        need = -(-head.num_tokens // state.block_size)
        assert f"queue head {head.request_id} needs {need} blocks, {len(state.free)} free" in (
            screen_text(app)
        )
        # Sorting by wait puts the longest wait first.
        await pilot.click(RequestTable, offset=(column_x(app, "wait"), 0))
        await wait_until(pilot, lambda: app.sort_key == "wait" and app.sort_reverse)
        waits = [x.wait if x.wait is not None else -1 for x in app.query_one(RequestTable).rows]
        assert waits == sorted(waits, reverse=True) and waits[0] > 0


def row(app, rid: str):  # type: ignore[no-untyped-def]
    return next(r for r in app.frame.requests if r.request_id == rid)


def column_x(app, title: str) -> int:  # type: ignore[no-untyped-def]
    """Where a column starts in the table as drawn (its id column fits the ids)."""
    table = app.query_one(RequestTable)
    width = table.scrollable_content_region.width
    return next(x for col, x, _ in table.columns(width) if col.title == title)


# -- 4. the event log ----------------------------------------------------------------------------


@app_test
async def test_event_log_focus_scroll_filter_and_no_break_lines() -> None:
    app = make_app(STORM, breakpoints=(parse("preempt"),))
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        await pilot.press("n")
        await at_step(pilot, 4)
        await pilot.press("n")
        await at_step(pilot, 17)
        await pilot.press("N")  # land on step 4 again: still one line per event
        await at_step(pilot, 4)
        await pilot.press("g", *"120", "enter")
        await at_step(pilot, 120)
        log = app.query_one(EventLog)
        await wait_until(pilot, lambda: any(e.step > 100 for e in log.events))
        assert all(e.kind != "break" for e in log.events)  # hits go to the status line
        assert len(set(log.events)) == len(log.events)
        while not log.has_focus:
            await pilot.press("tab")
        assert "c: kind" in screen_text(app)
        newest = screen_text(app)
        await pilot.press("home")
        await pilot.pause(0.05)
        top = screen_text(app)
        assert top != newest and f"{log._shown[0].text}" in top
        await pilot.press("c")  # preempt only
        await wait_until(pilot, lambda: log.kind == "preempt")
        assert log._shown and all(e.kind == "preempt" for e in log._shown)
        assert "events · preempt only" in screen_text(app)
        await pilot.press("c")  # admit
        await wait_until(pilot, lambda: log.kind == "admit")
        assert all(e.kind == "admit" for e in log._shown)
        assert "PREEMPT" not in widget_text(log)


# -- 5. 80x24 --------------------------------------------------------------------------------------


@app_test
async def test_80x24_keeps_mode_step_free_why_and_hints() -> None:
    app = make_app(STORM)
    async with app.run_test(size=SMALL) as pilot:
        await at_step(pilot, 0)
        await pilot.press("g", *"40", "enter")
        await at_step(pilot, 40)
        text = screen_text(app)
        lines = text.splitlines()
        assert "PAUSED" in lines[0] and "step 40 / 585" in lines[0]
        assert "free 3 / 63" in lines[1]
        assert "why not scheduled" in text
        await pilot.press("slash", *"preempted", "enter")  # every request ever preempted
        tl = Timeline(open_reader(STORM))
        ever = {r.request_id for r in tl.state(40).requests.values() if r.num_preemptions}
        table = app.query_one(RequestTable)
        await wait_until(pilot, lambda: {r.request_id for r in table.rows} == ever)
        text = screen_text(app)
        assert "no free KV blocks" in text and "behind the queue head" in text
        assert (
            "? " in lines[-1] and "help" in lines[-1] and "q " in lines[-1] and "quit" in lines[-1]
        )
        assert "prio" not in text and "out/max" not in text  # dropped first
        # The help screen scrolls when it does not fit.
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        box = app.screen.query_one("#help-box")
        assert box.max_scroll_y > 0
        first = screen_text(app)
        await pilot.press("pagedown")
        await wait_until(pilot, lambda: box.scroll_y > 0)
        assert screen_text(app) != first


def test_help_lists_every_key() -> None:
    import re

    from tui.app import SchedtopApp
    from tui.keys import KEYS

    listed = {t for _, keys in KEYS for key, _ in keys for t in re.split(r" / |, | ", key) if t}
    shown = {
        "right": "→", "left": "←", "shift+right": "shift+→", "shift+left": "←",
        "plus": "+", "equals_sign": "+", "minus": "-", "question_mark": "?", "slash": "/",
        "escape": "esc", "right_square_bracket": "]", "left_square_bracket": "[",
        "up": "↑", "down": "↓", "pageup": "pgup/dn", "pagedown": "pgup/dn", "k": "k", "j": "j",
    }  # fmt: skip
    listed |= {"pgup/dn"}
    bindings = [
        *SchedtopApp.BINDINGS,
        *IncidentsScreen.BINDINGS,
        *EventLog.BINDINGS,
        *RequestTable.BINDINGS,
        *IncidentTable.BINDINGS,
    ]
    for b in bindings:
        for key in b.key.split(","):  # type: ignore[union-attr]
            assert shown.get(key, key) in listed, f"{key} ({b.description}) is not in the help"


# -- 6. fixes ------------------------------------------------------------------------------------


@app_test
async def test_narrow_sort_arrow_goto_past_the_end_and_history_title() -> None:
    app = make_app(STORM)
    async with app.run_test(size=SMALL) as pilot:
        await at_step(pilot, 0)
        await pilot.press("g", *"99999", "enter")
        await at_step(pilot, 585)
        await wait_until(pilot, lambda: "went to the last step, 585" in screen_text(app))
        await pilot.press("g", *"40", "enter")
        await at_step(pilot, 40)
        await pilot.click(RequestTable, offset=(column_x(app, "pre"), 0))
        await wait_until(pilot, lambda: app.sort_key == "preempted" and app.sort_reverse)
        assert "pre▼" in screen_text(app).replace(" ", "")  # the arrow fits the 4-cell column
        sparks = app.query_one(Sparklines)
        lo, hi = sparks.drawn()  # type: ignore[misc]
        assert hi - lo + 1 < 160  # a narrow pane draws fewer than the window's 160 steps
        assert f"history: steps {lo}–{hi}" in screen_text(app)
        assert lo <= 40 <= hi


@app_test
async def test_aggregate_legend_and_legend_after_deselect(tmp_path: Path) -> None:
    from tests.tui_support import demo_workload, fixed_trace

    trace = fixed_trace(tmp_path, demo_workload(num_blocks=2048), name="pool.trace")
    app = make_app(trace)
    async with app.run_test(size=BIG) as pilot:
        await at_step(pilot, 0)
        blocks = app.query_one(BlockMap)
        assert blocks.geometry.zoom == "fit"  # 2048 blocks: the aggregate
        await wait_until(pilot, lambda: "a cell: " in screen_text(app))
        assert "¾" in screen_text(app) and "all" in screen_text(app)
        app.selected_block = 300
        await wait_until(pilot, lambda: "block 300" in screen_text(app))
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.selected_block is None)
        await wait_until(pilot, lambda: "a cell: " in screen_text(app))


def test_a_sim_trace_shows_engine_time_and_no_rate() -> None:
    s = Session(Timeline(open_reader(STORM)), name="storm")
    source = FrameSource(s, lambda: None, lambda *_: None)
    s.handle(Goto(40))
    frame = source.run_once()
    rec = s.tl.record(40)
    assert frame is not None and frame.header.tokens_per_s is None
    assert frame.header.step_ns == rec.schedule_ns + rec.update_ns
    assert frame.header.step_ns != rec.time_ns - s.tl.record(39).time_ns  # not the clock's


def test_a_live_trace_whose_writer_died_says_where_it_is_cut(tmp_path: Path) -> None:
    growing = tmp_path / "run-999999999.trace"
    data, offsets = growing_copy(STORM, growing, 30)
    with open(growing, "ab") as f:
        f.write(data[offsets[30] : offsets[30] + 20])  # half a record: the writer died
    clock = [100.0]
    s = Session(
        Timeline(open_reader(growing), live=True),
        name=growing.name,
        live=True,
        clock=lambda: clock[0],
        writer=Writer(999999999, lambda: False),
    )
    notices: list[tuple[str, str]] = []
    source = FrameSource(s, lambda: None, lambda *n: notices.append(n))
    frame = source.run_once()
    assert frame is not None and frame.header.step == 29 and not notices
    clock[0] += 5  # quiet for longer than IDLE_S
    frame = source.run_once()
    assert frame is not None and frame.header.ended and s.timeout() is None
    texts = [text for _, text in notices]
    assert any("writer (pid 999999999) is gone" in t for t in texts)
    assert any(f"cut at byte {offsets[30]:,}" in t and "ends at step 29" in t for t in texts)
