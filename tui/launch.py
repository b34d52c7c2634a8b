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

from recorder.errors import TraceError, UserError
from recorder.multi import SegmentedReader, open_trace, traces_in
from recorder.paths import SUFFIX, trace_dir
from recorder.reader import TraceReader
from replays.breakpoints import Predicate
from replays.timeline import Timeline
from tui.remote import RemoteStream
from tui.session import Session, Writer

KEYFRAME_INTERVAL = 32
HEADER_WAIT_S = 5.0  # live: how long a file whose header is still being written is waited for
RECENT_S = 10.0  # a trace without a footer written to this recently is being written
_PID = re.compile(r"-(\d+)(" + re.escape(SUFFIX) + ")?$")  # trace files and run directories
_CANDIDATES = 32  # newest traces looked at when attaching


class NoTerminal(UserError):
    """The app needs a terminal and there is none."""


def open_session(
    path: str | os.PathLike[str],
    *,
    live: bool,
    breakpoints: tuple[Predicate, ...] = (),
    named_writer: bool = True,
) -> Session:
    """A Session over the trace at `path`, checked down to its first step's state;
    live, its writer is watched when the file's name names one (`named_writer`).
    Raises TraceError for a file that cannot be shown."""
    reader = _open(path, live)
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
    pid = writer_pid(path) if live and named_writer else None
    return Session(
        timeline,
        name=Path(path).name,
        live=live,
        breakpoints=breakpoints,
        writer=None if pid is None else Writer(pid, lambda: _alive(pid)),
    )


def open_remote_session(url: str, api_key: str | None = None) -> tuple[Session, RemoteStream]:
    """A live Session over a server's stream, and the stream (close it after the app).
    Raises StreamError (a TraceError) when the server cannot be reached or refuses."""
    stream = RemoteStream(url, api_key)
    first = stream.start()
    try:
        # A spool file names no writer: the stream's link, not a pid, says whether the
        # server is there (a quiet server is idle, not gone).
        session = open_session(first, live=True, named_writer=False)
    except BaseException:
        stream.close()
        raise
    session.name = url
    session.link = stream.link
    session.count_window = session.incidents.window = "since attach"

    said_end = False

    def resync() -> tuple[Timeline, str] | None:
        nonlocal said_end
        if stream.ended and not said_end:
            said_end = True
            session.notices.append(("warning", stream.error or f"{url}: the stream ended"))
        path = stream.take_resync()
        if path is None:
            return None
        timeline = Timeline(TraceReader(path), live=True, keyframe_interval=KEYFRAME_INTERVAL)
        return timeline, stream.why(path)

    session.resync = resync
    return session, stream


def _open(path: str | os.PathLike[str], live: bool) -> TraceReader:
    """The trace file or run directory at `path`; live, one a writer is just starting is
    waited for (HEADER_WAIT_S at most)."""
    deadline = time.monotonic() + HEADER_WAIT_S
    while True:
        try:
            return open_trace(path)
        except TraceError as e:
            if not (live and e.incomplete and Path(path).exists()):
                raise
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.05)


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
    """Whether a trace (file or run directory) is still being written: it has no footer,
    and its writer (named in the file or directory name) is alive; a trace that names no
    writer must have changed in the last RECENT_S seconds. A writer that died a moment ago
    leaves a fresh file: its pid, not the file's age, says it is gone."""
    with open_trace(path) as reader:
        if reader.closed_cleanly:
            return False
        newest = reader.segments[-1] if isinstance(reader, SegmentedReader) else path
    pid = writer_pid(path)
    if pid is not None:
        return _alive(pid)
    now = time.time() if now is None else now
    return now - newest.stat().st_mtime < RECENT_S


def writer_pid(path: str | os.PathLike[str]) -> int | None:
    """The pid of the process that writes the trace, from its name (new_trace_path)."""
    m = _PID.search(Path(path).name)
    return int(m.group(1)) if m is not None else None


def choose(directory: Path | None = None) -> Choice | None:
    """The newest trace (file or run directory) being written in `directory` (default:
    the trace directory); else the newest readable one, to replay; None when there is
    none."""
    directory = trace_dir() if directory is None else directory
    names = traces_in(directory)[:_CANDIDATES]
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
