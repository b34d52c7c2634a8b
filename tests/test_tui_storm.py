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
from tests.tui_support import app_test, at_step, make_app, screen_text, wait_until
from tui.commands import SetBreakpoints, TogglePlay
from tui.screens.incidents import IncidentsScreen
from tui.session import Session
from tui.widgets.incidents import IncidentTable
from tui.widgets.requests import RequestTable
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
    return Session(Timeline(TraceReader(path), live=True), name=path.name, live=True, **kw)  # type: ignore[arg-type]


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
    s = Session(Timeline(TraceReader(STORM)), name="storm")
    notices: list[tuple[str, str]] = []
    source = FrameSource(s, lambda: None, lambda *n: notices.append(n))
    while s.incidents.busy:
        s.tick()
    s.handle(SetBreakpoints((parse("admit:s03"), parse("admit:nobody"))))
    frame = source.run_once()
    assert frame is not None and frame.header.breakpoints == ("admit:s03",)
    assert any("no request 'nobody'" in text for _, text in notices)
    out = subprocess.run(
        [sys.executable, "-m", "tui.cli", "find", str(STORM), "finish:nobody"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "no request 'nobody'" in out.stderr


@app_test
async def test_watchpoint_n_stops_once_per_transition() -> None:
    tl = Timeline(TraceReader(STORM))
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
