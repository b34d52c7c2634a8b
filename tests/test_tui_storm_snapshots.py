"""Screenshots of a preemption storm (replays/incidents/preemption_storm.trace): the main
screen and the incidents view, at 80x24 and 120x40. Regenerate after an intended change
with `--snapshot-update`, and look at the SVGs in tests/__snapshots__/ before committing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from tests.tui_support import at_step, make_app, wait_until
from tui.screens.incidents import IncidentsScreen
from tui.widgets.incidents import IncidentTable

STORM = Path(__file__).resolve().parent.parent / "replays" / "incidents" / "preemption_storm.trace"
SIZES = {"80x24": (80, 24), "120x40": (120, 40)}


async def _storm_step(pilot: Pilot[None]) -> None:
    app: Any = pilot.app
    await at_step(pilot, 0)
    await pilot.press("g", *"40", "enter")
    await at_step(pilot, 40)
    app.selected_request = "s12"  # preempted at step 19, still waiting
    await wait_until(
        pilot, lambda: "s12 waited" in str(app.query_one("#requests-pane").border_subtitle)
    )


@pytest.mark.parametrize("size", SIZES)
def test_main_screen_in_a_storm(snap_compare: Any, size: str) -> None:
    assert snap_compare(make_app(STORM), terminal_size=SIZES[size], run_before=_storm_step)


@pytest.mark.parametrize("size", SIZES)
def test_incidents_view(snap_compare: Any, size: str) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        app: Any = pilot.app
        await at_step(pilot, 0)
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, IncidentsScreen))
        table = app.screen.query_one(IncidentTable)
        await wait_until(pilot, lambda: app.screen.vm is not None and app.screen.vm.done)
        await wait_until(pilot, lambda: len(table.rows) == 25)
        await pilot.press("j", "j", "j", "j")  # the cursor on the fifth

    assert snap_compare(make_app(STORM), terminal_size=SIZES[size], run_before=run_before)
