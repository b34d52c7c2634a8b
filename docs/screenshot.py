"""Make the README's screenshots: the replay debugger on the preemption-storm incident,
rendered by Textual itself (SVG), at the first preemption and in the incidents view.

    .venv/bin/python docs/screenshot.py        # writes docs/img/*.svg
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from replays.breakpoints import parse
from tui.app import SchedtopApp
from tui.launch import open_session

ROOT = Path(__file__).resolve().parent
TRACE = ROOT.parent / "replays" / "incidents" / "preemption_storm.trace"


async def shoot() -> None:
    session = open_session(TRACE, live=False, breakpoints=(parse("preempt"),))
    app = SchedtopApp(session)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.5)
        await pilot.press("n")  # run to the first preemption
        await pilot.pause(1.0)
        app.save_screenshot("replay.svg", str(ROOT / "img"))
        await pilot.press("i")  # every preemption of the trace
        await pilot.pause(1.0)
        app.save_screenshot("incidents.svg", str(ROOT / "img"))
    session.close()


if __name__ == "__main__":
    asyncio.run(shoot())
