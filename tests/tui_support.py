"""Shared by the TUI tests: deterministic traces, and waiting on the app's reader thread."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from engine.sim.api import demo_workload_path
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload, load_workload
from recorder.recorder import Recorder, RecorderOptions
from recorder.writer import MemoryWriter
from replays.breakpoints import Predicate
from tests.helpers import close_later
from tui.app import SchedtopApp
from tui.launch import open_session

START_NS = 1_767_225_600 * 10**9  # the header's wall clock: 2026-01-01 00:00 UTC


class FakeClock:
    """A clock that moves by a varied but fixed amount per call, so that step times (and
    the step-time sparkline) are the same in every run."""

    def __init__(self, seconds: bool) -> None:
        self.t = 0
        self.calls = 0
        self.seconds = seconds

    def __call__(self) -> Any:
        self.calls += 1
        self.t += 200_000 + (self.calls * 2_654_435_761) % 900_000  # 0.2 .. 1.1 ms
        return self.t / 1e9 if self.seconds else self.t


def demo_workload(**overrides: Any) -> SimWorkload:
    return load_workload(demo_workload_path(), overrides)


def fixed_trace(
    directory: Path,
    w: SimWorkload | None = None,
    name: str = "demo.trace",
    snapshot_interval: int = 64,
) -> Path:
    """Record `w` (default: the built-in demo) with fixed clocks: the same bytes every run."""
    w = w or demo_workload()
    engine = make_engine(w)
    engine.clock = FakeClock(seconds=True)
    recorder = Recorder(
        engine,
        MemoryWriter(),
        RecorderOptions(
            strict=True,
            snapshot_interval=snapshot_interval,
            clock=FakeClock(seconds=False),
            wall_clock=lambda: START_NS,
        ),
    )
    for _ in run_steps(w, engine):
        pass
    engine.close()
    path = directory / name
    path.write_bytes(bytes(recorder.sink.data))
    return path


def app_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test (Pilot needs an event loop) as a plain pytest test."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return run


def make_app(
    path: Path, live: bool = False, breakpoints: tuple[Predicate, ...] = ()
) -> SchedtopApp:
    session = open_session(path, live=live, breakpoints=breakpoints)
    close_later(session.tl.reader)  # the app shows the session; the test owns it
    return SchedtopApp(session)


def screen_text(app: SchedtopApp) -> str:
    """The screen as plain text, line by line, as a terminal would show it."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def submit(pilot: Any, text: str) -> None:
    """Fill the focused input with `text` and press enter (typing long text key by key
    only makes a test slower: the tests type short text with press())."""
    pilot.app.focused.value = text
    await pilot.press("enter")


def widget_text(widget: Any) -> str:
    """What one pane shows, line by line (its region of the screen)."""
    region = widget.content_region
    lines = screen_text(widget.app).splitlines()[region.y : region.bottom]
    return "\n".join(line[region.x : region.right] for line in lines)


async def wait_until(pilot: Any, condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Let the app (and its reader thread) run until `condition` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)
    await pilot.pause(0.02)  # let the panes repaint


async def at_step(pilot: Any, step: int, timeout: float = 10.0) -> None:
    """Wait until the app shows `step` (and the frame on screen is the newest)."""
    app = pilot.app

    def shown() -> bool:
        f = app.frame
        return f is not None and f.header.step == step and f.header.mode != "SEARCHING"

    await wait_until(pilot, shown, timeout)


def queueing_workload(policy: str = "fcfs") -> dict[str, Any]:
    """A head-of-line-blocking incident as a `schedtop sim` workload: three long decodes
    hold most of a 40-block pool, a 300-token prompt reaches the queue head and cannot be
    admitted, and the short chats that arrive behind it wait though each would fit. Ids
    look like an OpenAI server's (`chatcmpl-` and 32 hex digits), so that widths matter;
    under `policy="priority"` the chats outrank the prompt (priority 0 against 5)."""

    def req(n: int, arrival: int, prompt: int, out: int, priority: int) -> dict[str, Any]:
        rid = f"chatcmpl-{n:04x}{(n * 2_654_435_761) % 16**28:028x}"
        toks = [1000 + 100 * n + i for i in range(prompt)]
        return {
            "id": rid,
            "arrival_step": arrival,
            "prompt_token_ids": toks,
            "output_token_ids": [50_000 + i for i in range(out)],
            "max_tokens": out,
            "priority": priority,
        }

    holders = [req(n, 0, 160, 40, 1) for n in range(3)]
    big = req(3, 4, 300, 4, 5)
    chats = [req(n, 5 + n, 16, 6, 0) for n in range(4, 10)]
    return {
        "description": "head-of-line blocking: a 300-token prompt at the queue head",
        "config": {
            "block_size": 16,
            "num_blocks": 41,
            "max_num_batched_tokens": 512,
            "max_num_seqs": 16,
            "policy": policy,
            "enable_prefix_caching": True,
        },
        "requests": [*holders, big, *chats],
    }


def queueing_trace(directory: Path, policy: str = "fcfs") -> Path:
    """`schedtop sim` of queueing_workload(policy), run as a user runs it, into
    directory/hol.trace."""
    workload = directory / "hol.json"
    workload.write_text(json.dumps(queueing_workload(policy)))
    trace = directory / "hol.trace"
    subprocess.run(
        [sys.executable, "-m", "tui.cli", "sim", str(workload), "--trace", str(trace)],
        check=True,
        capture_output=True,
    )
    return trace
