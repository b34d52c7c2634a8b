"""schedtop replay in a real terminal: tmux runs it in a 120x40 window, keys are sent as
a person would type them, and the captured screen is read back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from replays.breakpoints import find, parse
from replays.timeline import Timeline
from tests.helpers import open_reader

CASE = Path(__file__).parent / "data" / "fidelity" / "c_kv_pressure_prefix.workload.json"
TIMEOUT_S = 20.0


class TmuxError(subprocess.CalledProcessError):
    def __str__(self) -> str:  # what tmux said, not only its status
        return f"{super().__str__()}: {str(self.stderr).strip()}"


class Tmux:
    """One tmux server of our own (its own socket), so that nothing else is touched."""

    def __init__(self, name: str) -> None:
        self.socket = name

    def __call__(self, *args: str) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise TmuxError(done.returncode, done.args, done.stdout, done.stderr)
        return done.stdout

    def start(self, args: str, width: int = 120, height: int = 40) -> None:
        """`schedtop ARGS` in a new session "app", a colour terminal of width x height."""
        # COLUMNS and LINES from the test's environment would override the window's size.
        command = f"env -u COLUMNS -u LINES {sys.executable} -m tui.cli {args}"
        env = ("TERM=xterm-256color", "COLORTERM=truecolor")
        size = ("-x", str(width), "-y", str(height))
        self("new-session", "-d", "-s", "app", *size, *[a for e in env for a in ("-e", e)], command)

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "app")

    def wait_for(self, check: Callable[[str], bool], what: str, may_end: bool = False) -> str:
        """The screen once `check` holds. `may_end`: the app may exit meanwhile, and with
        its session our tmux server ends too, so that capture-pane finds nothing to read;
        that screen is the empty one."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                screen = self.screen()
            except subprocess.CalledProcessError:
                if not may_end:
                    raise
                screen = ""
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} on the screen:\n{screen}")
            time.sleep(0.1)


def first_row(screen: str, step: int) -> list[str] | None:
    """The incidents view's row of the preemption at `step`: victim and cause."""
    rows = [line.replace("▶", " ").split() for line in screen.splitlines()]
    return next((r[2:4] for r in rows if r[:2] == [str(step), "preempt"]), None)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (.ci/run installs it)")
    # A socket per test: the last test's server may still be exiting (its app quit, and
    # with its only session the server goes), and a new session must not meet it.
    t = Tmux(f"schedtop-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield t
    subprocess.run(["tmux", "-L", t.socket, "kill-server"], capture_output=True)


def test_replay_in_a_real_terminal(tmux: Tmux, tmp_path: Path) -> None:
    trace = tmp_path / "kv.trace"
    subprocess.run(
        [sys.executable, "-m", "tui.cli", "sim", str(CASE), "--trace", str(trace)],
        check=True,
        capture_output=True,
    )
    tl = Timeline(open_reader(trace))
    preempted = find(tl, [parse("preempt")], -1)
    assert preempted is not None
    victim = tl.state(preempted - 1).requests[tl.record(preempted).preemptions[0].victim]
    tmux.start(f"replay {trace}")
    last = tl.last_step
    # Each wait is for everything the test then reads: the app draws in more than one
    # frame, and the first capture with the step line may not have the rest yet.
    tmux.wait_for(lambda s: f"step 0 / {last}" in s and "PAUSED" in s and "kv.trace" in s, "step 0")
    tmux("send-keys", "-t", "app", "Right")
    tmux.wait_for(lambda s: f"step 1 / {last}" in s, "step 1")
    tmux("send-keys", "-t", "app", "S-Right")
    tmux.wait_for(lambda s: f"step 11 / {last}" in s, "step 11")
    tmux("send-keys", "-t", "app", "b")
    tmux.wait_for(lambda s: "● preempt" in s, "the breakpoint")
    tmux("send-keys", "-t", "app", "Home", "n")
    tmux.wait_for(
        lambda s: (
            f"step {preempted} / {last}" in s
            and f"PREEMPT {victim.request_id} preempted" in s
            and f"breakpoint hit at step {preempted}: preempt" in s
        ),
        "the preemption, in the event log",
    )
    tmux("send-keys", "-t", "app", "q")
    tmux.wait_for(lambda s: "PAUSED" not in s, "the app gone", may_end=True)


def test_first_preemption_victim_and_cause_from_the_incidents_view_at_80x24(
    tmux: Tmux,
) -> None:
    """What a newcomer does in a small terminal: open the storm, press i, read the first
    preemption's victim and cause, press enter to land on its step with keys only."""
    storm = Path(__file__).resolve().parent.parent / "replays" / "incidents"
    trace = storm / "preemption_storm.trace"
    tl = Timeline(open_reader(trace))
    step = find(tl, [parse("preempt")], -1)
    assert step is not None
    p = tl.record(step).preemptions[0]
    before = tl.state(step - 1)
    victim = before.request_id(p.victim)
    cause = "itself" if p.victim == p.for_request else before.request_id(p.for_request)
    tmux.start(f"replay {trace}", 80, 24)
    last = tl.last_step
    tmux.wait_for(
        lambda s: (
            f"step 0 / {last}" in s
            and "? help" in s.replace("  ", " ")
            and "q quit" in s.replace("  ", " ")
        ),
        "step 0 and the key hints",
    )
    tmux("send-keys", "-t", "app", "i")
    screen = tmux.wait_for(
        lambda s: "25 preemptions in 586 steps" in s and first_row(s, step) is not None,
        "the incidents view with its first preemption",
    )
    assert first_row(screen, step) == [victim, cause]  # the victim, and for whom
    tmux("send-keys", "-t", "app", "Enter")
    why = "preempted itself (no KV)" if cause == "itself" else f"preempted for {cause}"
    # The preemption's step, the victim's row scrolled into view, saying why.
    tmux.wait_for(
        lambda s: (
            f"step {step} / {last}" in s
            and any(victim in line and why in line for line in s.splitlines())
        ),
        "the victim",
    )
    tmux("send-keys", "-t", "app", "q")
    tmux.wait_for(lambda s: "PAUSED" not in s, "the app gone", may_end=True)
