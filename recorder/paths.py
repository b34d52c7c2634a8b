"""Where traces go when no path is given: one new file per run in the trace directory,
named so that names sort by start time."""

from __future__ import annotations

import os
import time
from pathlib import Path

from recorder.errors import RecordingError

TRACE_DIR_ENV = "SCHEDTOP_TRACE_DIR"
SUFFIX = ".trace"


def trace_dir() -> Path:
    """`$SCHEDTOP_TRACE_DIR`, else `~/.cache/schedtop/traces`."""
    configured = os.environ.get(TRACE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "schedtop" / "traces"


def make_trace_dir(directory: Path) -> None:
    """Create `directory` (and its parents) if need be; RecordingError says why not."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecordingError(
            f"{directory}: cannot create the trace directory: {e.strerror}"
        ) from None


def new_trace_path(kind: str, now_ns: int | None = None) -> Path:
    """A fresh path such as `20250101-120000.123-sim-4242.trace` (UTC) in trace_dir()."""
    return trace_dir() / f"{_stem(kind, now_ns)}{SUFFIX}"


def new_run_dir(kind: str, parent: Path | None = None, now_ns: int | None = None) -> Path:
    """A fresh directory name for one run's segments, such as `20250101-120000.123-serve-4242`
    in `parent` (default: trace_dir()); it sorts among the trace files by start time."""
    return (trace_dir() if parent is None else parent) / _stem(kind, now_ns)


def _stem(kind: str, now_ns: int | None) -> str:
    now_ns = time.time_ns() if now_ns is None else now_ns
    seconds, rest = divmod(now_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds))
    return f"{stamp}.{rest // 1_000_000:03d}-{kind}-{os.getpid()}"


def latest_trace(directory: Path | None = None) -> Path | None:
    """The newest trace in `directory` (default: trace_dir()), by name; None if none."""
    directory = trace_dir() if directory is None else directory
    try:
        names = [p for p in directory.iterdir() if p.name.endswith(SUFFIX) and p.is_file()]
    except OSError:
        return None
    return max(names, key=lambda p: p.name, default=None)
