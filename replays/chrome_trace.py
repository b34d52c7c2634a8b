"""A streaming writer of the Chrome trace-event format (JSON object form), which Perfetto
(ui.perfetto.dev) and chrome://tracing open.

Events go to the file as they come, so memory does not grow with the trace. The file is
written beside its destination under a temporary name and renamed at the end: a failed
export leaves the destination as it was, never half-written.

Two choices keep the output readable by every version of Perfetto's JSON importer, whose
tokenizer is stricter than the format:
- each event's keys come in the order ph, name, cat, ts, ...: that tokenizer looks for
  `ts` by scanning keys in order and gives up on the whole file at an array value met
  before it (the helpers below build events in that order; callers keep args free of
  lists);
- `traceEvents` comes first and the only other top-level key is `otherData`: an unknown
  key makes it ignore the rest of the file. There is no `displayTimeUnit`: some Perfetto
  versions take "ns" there to mean that timestamps are in ns, which the format says they
  are not.

Timestamps are whole microseconds, the format's unit. Callers compute every boundary in
integer ns and round each boundary (`us`), never a duration: rounding is monotonic, so
slices that touch or nest in ns still touch or nest exactly, where float microseconds
could overlap by a rounding error and mis-nest in a viewer.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

Event = dict[str, Any]

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


class ExportError(Exception):
    """The output file cannot be written (its directory is missing, not writable, full)."""


def us(ns: int) -> int:
    """A boundary in ns as the format's timestamp: whole microseconds, rounded."""
    return (ns + 500) // 1000


def complete(
    name: str,
    cat: str,
    start_ns: int,
    end_ns: int,
    pid: int,
    tid: int,
    args: dict[str, Any] | None = None,
) -> Event:
    """A complete ("X") event: a slice from start_ns to end_ns on thread (pid, tid)."""
    ts = us(start_ns)
    ev: Event = {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": ts,
        "dur": us(end_ns) - ts,
        "pid": pid,
        "tid": tid,
    }
    if args:
        ev["args"] = args
    return ev


def instant(
    name: str, cat: str, at_ns: int, pid: int, tid: int, args: dict[str, Any] | None = None
) -> Event:
    """A thread-scoped instant ("i") event."""
    ev: Event = {
        "ph": "i",
        "name": name,
        "cat": cat,
        "ts": us(at_ns),
        "pid": pid,
        "tid": tid,
        "s": "t",
    }
    if args:
        ev["args"] = args
    return ev


def counter(name: str, at_ns: int, pid: int, values: dict[str, int | float]) -> Event:
    """A counter ("C") event: each key of `values` is one series of the counter `name`."""
    return {
        "ph": "C",
        "name": name,
        "cat": "counter",
        "ts": us(at_ns),
        "pid": pid,
        "tid": pid,
        "args": values,
    }


def flow(phase: str, name: str, flow_id: int, at_us: int, pid: int, tid: int) -> Event:
    """A flow event: "s" starts flow `flow_id` in the slice enclosing `at_us` on (pid,
    tid); "f" ends it in the slice enclosing `at_us` there (bp "e": enclosing, not the
    next slice)."""
    ev: Event = {
        "ph": phase,
        "name": name,
        "cat": "flow",
        "ts": at_us,
        "pid": pid,
        "tid": tid,
        "id": flow_id,
    }
    if phase == "f":
        ev["bp"] = "e"
    return ev


def metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> Event:
    """A metadata ("M") event: process_name, thread_name, process_sort_index, ..."""
    return {"ph": "M", "name": name, "ts": 0, "pid": pid, "tid": tid, "args": args}


class EventWriter:
    """Writes events into an open text file; `count` is how many so far."""

    def __init__(self, f: IO[str]) -> None:
        self._f = f
        self._sep = ""
        self.count = 0
        f.write('{"traceEvents":[\n')

    def write(self, event: Event) -> None:
        self._f.write(self._sep)
        self._f.write(_encode(event))
        self._sep = ",\n"
        self.count += 1

    def finish(self, other_data: dict[str, Any]) -> None:
        """Close the event list; `other_data` is the trace's metadata (shown by the
        viewers' metadata panels)."""
        self._f.write('\n],\n"otherData":')
        self._f.write(_encode(other_data))
        self._f.write("}\n")


@contextmanager
def atomic_events(path: Path) -> Iterator[EventWriter]:
    """An EventWriter whose file becomes `path` only when the block ends without an
    error (the caller calls finish()). Any OSError becomes an ExportError naming `path`;
    any error removes the temporary file."""
    path = Path(os.path.realpath(path))  # through a link: replace its target, not the link
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        f = open(tmp, "x", encoding="utf-8", newline="\n")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise ExportError(f"{path}: cannot write: {e.strerror or e}") from None
    done = False
    try:
        with f:
            yield EventWriter(f)
        os.replace(tmp, path)
        done = True
    except OSError as e:
        raise ExportError(f"{path}: cannot write: {e.strerror or e}") from None
    finally:
        if not done:
            with suppress(OSError):
                tmp.unlink()
