"""Opening a trace for the app, and finding the one to attach to.

Everything that can be wrong with a trace file is found here, before the app starts, and
raised as TraceError (the command prints it in one line and exits with status 2). The
Timeline built here is handed over to the app's reader thread, which owns it from then on.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from recorder.errors import TraceError
from recorder.paths import SUFFIX, trace_dir
from recorder.reader import TraceReader
from replays.breakpoints import Predicate
from replays.timeline import Timeline
from tui.session import Session, Writer

KEYFRAME_INTERVAL = 32
HEADER_WAIT_S = 5.0  # live: how long a file whose header is still being written is waited for
RECENT_S = 10.0  # a trace without a footer written to this recently is being written
_PID = re.compile(r"-(\d+)" + re.escape(SUFFIX) + "$")
_CANDIDATES = 32  # newest traces looked at when attaching


class NoTerminal(Exception):
    """The app needs a terminal and there is none."""


def open_session(
    path: str | os.PathLike[str], *, live: bool, breakpoints: tuple[Predicate, ...] = ()
) -> Session:
    """A Session over the trace at `path`, checked down to its first step's state.
    Raises TraceError for a file that cannot be shown."""
    try:
        reader = TraceReader(path)
    except TraceError as e:
        if not (live and e.incomplete and Path(path).exists()):
            raise
        reader = TraceReader.wait_for(path, HEADER_WAIT_S)  # a writer just starting
    try:
        # Keyframes every 32 steps rather than 16: a jump copies the state half as often
        # (a quarter less time on a 256-request trace), and a step back still costs a few
        # milliseconds.
        timeline = Timeline(reader, live=live, keyframe_interval=KEYFRAME_INTERVAL)
        if timeline.num_steps:
            timeline.state(timeline.first_step)  # the first record decodes and applies
        else:
            timeline.state(timeline.first_step - 1)  # a mid-run trace has its snapshot
    except TraceError as e:
        reader.close()
        e.path = e.path or str(path)
        raise
    except BaseException:
        reader.close()
        raise
    pid = writer_pid(path) if live else None
    return Session(
        timeline,
        name=Path(path).name,
        live=live,
        breakpoints=breakpoints,
        writer=None if pid is None else Writer(pid, lambda: _alive(pid)),
    )


def run_app(session: Session) -> None:
    """Show `session` in the app until the user quits; the session is closed after."""
    try:
        if not sys.stdout.isatty():
            raise NoTerminal(
                "the schedtop app needs a terminal; `schedtop info TRACE` prints a summary instead"
            )
        from tui.app import SchedtopApp

        SchedtopApp(session).run()
    finally:
        session.close()


@dataclass(frozen=True, slots=True)
class Choice:
    """What `schedtop` with no arguments opens."""

    path: Path  # the trace
    live: bool  # it is being written: follow it


def being_written(path: Path, now: float | None = None) -> bool:
    """Whether a trace is still being written: it has no footer, and its writer (named in
    the file name) is alive; a file that names no writer must have changed in the last
    RECENT_S seconds. A writer that died a moment ago leaves a fresh file: its pid, not
    the file's age, says it is gone."""
    with TraceReader(path) as reader:
        if reader.closed_cleanly:
            return False
    pid = writer_pid(path)
    if pid is not None:
        return _alive(pid)
    now = time.time() if now is None else now
    return now - path.stat().st_mtime < RECENT_S


def writer_pid(path: str | os.PathLike[str]) -> int | None:
    """The pid of the process that writes the trace, from its name (new_trace_path)."""
    m = _PID.search(Path(path).name)
    return int(m.group(1)) if m is not None else None


def choose(directory: Path | None = None) -> Choice | None:
    """The newest trace being written in `directory` (default: the trace directory);
    else the newest readable trace, to replay; None when there is none."""
    directory = trace_dir() if directory is None else directory
    try:
        names = sorted(
            (p for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.is_file()),
            key=lambda p: p.name,
            reverse=True,
        )[:_CANDIDATES]
    except OSError:
        return None
    finished: Path | None = None
    for path in names:
        try:
            if being_written(path):
                return Choice(path, True)
        except (TraceError, OSError):
            continue  # unreadable, or gone since the listing
        finished = finished or path
    return None if finished is None else Choice(finished, False)


def nothing_to_attach(directory: Path) -> str:
    """What `schedtop` says when there is no trace to show."""
    return (
        f"schedtop: no trace in {directory} to show. Start an engine that records one:\n"
        "  schedtop demo          the engine on the built-in workload, shown live\n"
        "  schedtop demo --sim    the same with the simulated model\n"
        "  schedtop run           the engine on the default model (records a trace)\n"
        "  schedtop sim           the scheduler with a simulated model (records a trace)\n"
        "then run `schedtop` again, or `schedtop replay TRACE` for a trace elsewhere."
    )


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    except OSError:
        return False
    return True
