"""Issue 15 in the app, driven with Pilot on the incident traces: the incidents view and
its jump, wait accounting, watchpoints, the event log, the 80x24 layout and the fixes."""

from __future__ import annotations

from pathlib import Path

from textual import events

from replays.storms import scan
from tests.tui_support import app_test, at_step, make_app, screen_text, wait_until
from tui.screens.incidents import IncidentsScreen
from tui.widgets.incidents import IncidentTable
from tui.widgets.requests import RequestTable

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
