"""Screenshots of the app (pytest-textual-snapshot), compared with the accepted ones in
tests/__snapshots__/. Deterministic: a trace recorded with fixed clocks from a fixed
workload, a fixed terminal size, and nothing on screen that reads the clock.

After an intended change: `.venv/bin/python -m pytest tests/test_tui_snapshots.py
--snapshot-update`, then look at the new SVGs before committing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from replays.breakpoints import parse
from tests.tui_support import at_step, demo_workload, fixed_trace, make_app, wait_until
from tui.screens.help import HelpScreen
from tui.widgets.blockmap import BlockMap

SIZE = (120, 40)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixed_trace(tmp_path_factory.mktemp("snap"))


@pytest.fixture(scope="module")
def big_pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo workload on a pool of 2048 blocks: too many for one cell each."""
    return fixed_trace(
        tmp_path_factory.mktemp("snap"), demo_workload(num_blocks=2048), name="pool2048.trace"
    )


def test_main_screen_at_a_preemption(snap_compare: Any, demo: Path) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        app = pilot.app
        await at_step(pilot, 0)
        await pilot.press("n")
        await at_step(pilot, 14)  # the first preemption of the demo
        app.selected_request = "req-08"  # the request that needed the blocks
        app.selected_block = 40
        await pilot.pause(0.05)

    assert snap_compare(
        make_app(demo, breakpoints=(parse("preempt"),)), terminal_size=SIZE, run_before=run_before
    )


def _at_pool_step(zooms: int):  # type: ignore[no-untyped-def]
    async def run_before(pilot: Pilot[None]) -> None:
        await at_step(pilot, 0)
        await pilot.press("g", *"60", "enter")
        await at_step(pilot, 60)
        blocks = pilot.app.query_one(BlockMap)
        for _ in range(zooms):
            await pilot.press("z")
        pilot.app.selected_block = 300
        await wait_until(pilot, lambda: blocks.selected == 300)

    return run_before


def test_block_map_aggregated(snap_compare: Any, big_pool: Path) -> None:
    assert snap_compare(make_app(big_pool), terminal_size=SIZE, run_before=_at_pool_step(0))


def test_block_map_zoomed_two_blocks_per_cell(snap_compare: Any, big_pool: Path) -> None:
    assert snap_compare(make_app(big_pool), terminal_size=SIZE, run_before=_at_pool_step(3))


def test_help_screen(snap_compare: Any, demo: Path) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await at_step(pilot, 0)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen))

    assert snap_compare(make_app(demo), terminal_size=SIZE, run_before=run_before)
