"""`schedtop demo`: an engine in a background process records a new trace, and the app
(or, headless, a few progress lines) follows it live.

The engine never runs in the viewer's process: the viewer reads the trace the engine
writes, as it would for any other engine.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from recorder.errors import TraceError
from recorder.paths import new_trace_path
from recorder.reader import TraceReader
from replays.timeline import Timeline
from tui.history import History

OPEN_TIMEOUT_S = 120.0  # loading the model may take a while before the first record
REPORT_EVERY_S = 1.0  # headless: a progress line at most this often
DEFAULT_PACE = 25  # the simulated engine's steps per second, so that a person can watch


class DemoError(Exception):
    """The engine process failed."""


def engine_command(path: Path, sim: bool, pace: float) -> list[str]:
    """The engine process: the real model (`schedtop run`) or the simulated one."""
    if sim:
        return [sys.executable, "-m", "tui.cli", "sim", "--trace", str(path), "--pace", f"{pace:g}"]
    return [sys.executable, "-m", "tui.cli", "run", "--trace", str(path)]


class Engine:
    """The engine process and where its output goes."""

    def __init__(self, sim: bool, pace: float) -> None:
        self.path = new_trace_path("demo")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.log = self.path.with_suffix(".log")
        self.sim = sim
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                engine_command(self.path, sim, pace),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait_for_trace(self) -> None:
        """Until the trace has its header; DemoError if the engine dies first."""
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while True:
            try:
                TraceReader(self.path).close()
                return
            except TraceError as e:
                if not e.incomplete:
                    raise
            if self.proc.poll() is not None:
                message = self.failure("stopped before writing its trace")
                self.log.unlink(missing_ok=True)  # its gist is in the message
                raise DemoError(message)
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the engine wrote no trace in {OPEN_TIMEOUT_S:.0f} s (its output: {self.log})"
                )
            time.sleep(0.05)

    def failure(self, what: str) -> str:
        code = self.proc.wait()
        tail = [line.strip() for line in self.output().splitlines() if line.strip()][-2:]
        hint = "" if self.sim else " (try `schedtop demo --sim`, the simulated engine)"
        return f"the engine {what} (exit status {code}){hint}: " + (
            " / ".join(tail) if tail else "no output"
        )

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """End the engine if it is still running (the viewer quit first)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def follow_headless(engine: Engine, echo: Callable[[str], None]) -> None:
    """Print a progress line about once a second while the engine runs, and the last."""
    with TraceReader(engine.path) as reader:
        timeline = Timeline(reader, live=True)
        history = History(capacity=16)
        preemptions = 0
        done = timeline.first_step - 1  # the last step counted
        shown = done  # the last step a line was printed for
        last_report = 0.0
        while True:
            exited = engine.proc.poll() is not None  # before the refresh: it sees the end
            timeline.refresh()
            for step in range(done + 1, timeline.last_step + 1):
                preemptions += len(timeline.record(step).preemptions)
            if timeline.last_step > done:
                done = timeline.last_step
                now = time.monotonic()
                if now - last_report >= REPORT_EVERY_S:
                    last_report, shown = now, done
                    echo(progress(timeline, history, preemptions))
            if timeline.finished or exited:
                break
            time.sleep(0.05)
        if engine.proc.wait() != 0:
            raise DemoError(engine.failure("failed"))
        if done > shown:
            echo(progress(timeline, history, preemptions))


def progress(timeline: Timeline, history: History, preemptions: int) -> str:
    """One line: step, queues, free blocks, preemptions so far."""
    history.fill(timeline, timeline.last_step, timeline.last_step)
    d = history.get(timeline.last_step)
    if d is None:
        return f"step {timeline.last_step}"
    usable = timeline.header.num_blocks - 1
    return (
        f"step {d.step:>6}  running {d.running:>4}  waiting {d.waiting:>4}  "
        f"free blocks {d.free_blocks:>5}/{usable}  preemptions {preemptions}"
    )
