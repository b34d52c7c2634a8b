"""Every view at 80x24, 120x40 and 200x60 (issue 27, item 5), on a head-of-line
incident with server-like ids (`chatcmpl-` and 32 hex digits) under the priority policy:
ids cut in the middle, `prio` kept, the waits section, the tables' widths. Regenerate
after an intended change with `--snapshot-update`, and look at the SVGs in
tests/__snapshots__/ before committing."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from engine.sim.workload import load_workload
from tests.tui_support import at_step, fixed_trace, make_app, queueing_workload, wait_until
from tui.screens.help import HelpScreen
from tui.screens.incidents import IncidentsScreen

SIZES = {"80x24": (80, 24), "120x40": (120, 40), "200x60": (200, 60)}
STEP = 20  # the big prompt at the queue head, the chats behind it


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("widths")
    path = d / "queueing.json"
    path.write_text(json.dumps(queueing_workload("priority")))
    return fixed_trace(d, load_workload(path), name="queueing.trace")


async def _at_step(pilot: Pilot[None]) -> None:
    app: Any = pilot.app
    await at_step(pilot, 0)
    await pilot.press("g", *str(STEP), "enter")
    await at_step(pilot, STEP)
    head = next(r for r in app.frame.requests if r.state == "waiting")
    app.selected_request = head.request_id
    await wait_until(
        pilot, lambda: "waited" in str(app.query_one("#requests-pane").border_subtitle)
    )


async def _incidents(pilot: Pilot[None]) -> None:
    app: Any = pilot.app
    await _at_step(pilot)
    await pilot.press("i")
    await wait_until(pilot, lambda: isinstance(app.screen, IncidentsScreen))
    await wait_until(pilot, lambda: app.screen.vm is not None and app.screen.vm.done)


async def _maximized(pilot: Pilot[None]) -> None:
    app: Any = pilot.app
    await _at_step(pilot)
    await pilot.press("m")
    await wait_until(pilot, lambda: app.screen.maximized is not None)


async def _help(pilot: Pilot[None]) -> None:
    await at_step(pilot, 0)
    await pilot.press("question_mark")
    await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))


VIEWS: dict[str, Callable[[Pilot[None]], Awaitable[None]]] = {
    "main": _at_step,
    "incidents": _incidents,
    "maximized": _maximized,
    "help": _help,
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("view", VIEWS)
def test_view_at_width(snap_compare: Any, trace: Path, view: str, size: str) -> None:
    assert snap_compare(make_app(trace), terminal_size=SIZES[size], run_before=VIEWS[view])
