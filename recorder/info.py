"""`schedtop info TRACE`: what a trace holds and whether it is whole, in a few lines."""

from __future__ import annotations

import datetime
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path

from recorder.errors import TraceError
from recorder.multi import SegmentedReader, open_trace
from recorder.reader import Cut, TraceReader
from recorder.schema import Header, Snapshot, Step, printable


@dataclass(frozen=True, slots=True)
class TraceSummary:
    """Totals of one trace, from its footer or, when it has none, from a full read."""

    path: Path  # the file
    size: int  # bytes
    version: tuple[int, int]  # format (major, minor)
    header: Header  # the header record
    first_step: int  # the first step (first_step - 1 = last_step: no steps)
    last_step: int  # the last whole step
    duration_s: float  # from the start of recording to the end of the last step
    num_arrivals: int  # requests that arrived
    num_finishes: int  # requests that finished
    num_preemptions: int  # preemptions
    num_snapshots: int  # snapshot records
    closed_cleanly: bool  # the writer closed it (footer present)
    cut: Cut | None  # where an incomplete last record starts, if any
    end: int  # where the last whole record ends
    segments: tuple[Path, ...] = ()  # a run directory's segment files, oldest first
    first_time_s: float = 0.0  # when the first step ended (a mid-run trace's steps/s)
    stopped: str = ""  # why recording stopped before the engine did (the footer's)
    work_s: float | None = None  # the steps' work (format 1.4); None: some step lacks it


def summarize(path: str | os.PathLike[str]) -> TraceSummary:
    """Read `path` and total it up; raises TraceError if it is not a readable trace."""
    try:
        return _summarize(path)
    except TraceError as e:
        e.path = str(path)
        raise


def _summarize(path: str | os.PathLike[str]) -> TraceSummary:
    with open_trace(path) as reader:
        size = reader.size if isinstance(reader, SegmentedReader) else reader.path.stat().st_size
        # Every record is read and checked, footer or not: a footer only says the writer
        # got to the end, not that what lies before it is whole (issue 14).
        last_step, last_time, totals, end, work_ns = _count(reader, size)
        footer = reader.footer
        if footer is not None:
            _check_footer(reader, last_step, totals)
        return TraceSummary(
            reader.path,
            size,
            reader.version,
            reader.header,
            reader.header.first_step,
            last_step,
            last_time / 1e9,
            *totals,
            closed_cleanly=footer is not None,
            stopped=footer.stopped if footer is not None else "",
            cut=reader.cut,
            end=end,
            segments=tuple(reader.segments) if isinstance(reader, SegmentedReader) else (),
            first_time_s=_first_time(reader, last_step) / 1e9,
            work_s=None if work_ns is None else work_ns / 1e9,
        )


def _check_footer(reader: TraceReader, last_step: int, totals: tuple[int, int, int, int]) -> None:
    """The footer's counts must be the records' own."""
    footer = reader.footer
    assert footer is not None
    claimed = (
        footer.num_arrivals,
        footer.num_finishes,
        footer.num_preemptions,
        len(footer.snapshot_offsets),
    )
    names = ("arrivals", "finishes", "preemptions", "snapshots")
    for name, said, found in zip(names, claimed, totals):
        if said != found:
            raise TraceError(f"footer: says {said} {name}, the records hold {found}")
    if reader.index().last_step != last_step:
        raise TraceError(
            f"footer: says the last step is {reader.index().last_step}, the records end "
            f"at step {last_step}"
        )


def _first_time(reader: TraceReader, last_step: int) -> int:
    """When a mid-run trace's first step ended (0 for one that starts at step 0)."""
    if reader.header.first_step == 0 or last_step < reader.header.first_step:
        return 0
    first = next(reader.steps(), None)
    return first.time_ns if first is not None else 0


def _count(
    reader: TraceReader, size: int
) -> tuple[int, int, tuple[int, int, int, int], int, int | None]:
    last_step = reader.header.first_step - 1
    last_time = arrivals = finishes = preemptions = snapshots = 0
    work: int | None = 0  # the steps' work_ns; None once a step has none
    for entry in reader.entries():
        rec = entry.record
        if isinstance(rec, Step):
            last_step, last_time = rec.step, rec.time_ns
            work = work + rec.work_ns if work is not None and rec.work_ns else None
            arrivals += len(rec.arrivals)
            finishes += len(rec.finishes)
            preemptions += len(rec.preemptions)
        elif isinstance(rec, Snapshot):
            snapshots += 1
    end = reader.cut.offset if reader.cut is not None else size
    return last_step, last_time, (arrivals, finishes, preemptions, snapshots), end, work


def format_summary(s: TraceSummary) -> str:
    h = s.header
    started = datetime.datetime.fromtimestamp(h.start_time_ns / 1e9, datetime.UTC)
    steps = s.last_step - s.first_step + 1
    rate = ""
    if s.first_time_s and s.duration_s > s.first_time_s and steps > 1:
        rate = f", {(steps - 1) / (s.duration_s - s.first_time_s):.0f} steps/s"
    elif not s.first_time_s and s.duration_s > 0:
        rate = f", {steps / s.duration_s:.0f} steps/s"
    # A mid-run trace (a segment, an incident) spans part of the recording's clock.
    when = (
        f"time {s.first_time_s:.3f}..{s.duration_s:.3f} s"
        if s.first_time_s
        else f"duration {s.duration_s:.3f} s"
    )
    if s.work_s is not None and s.last_step >= s.first_step:
        # wall time stays the duration; how much of it the engine worked is said beside it
        span = s.duration_s - s.first_time_s
        when += f" (work {s.work_s:.3f} s, idle {max(0.0, span - s.work_s):.3f} s)"
    knobs = textwrap.wrap(
        " ".join(f"{k}={v}" for k, v in sorted(h.config.items())), 88, subsequent_indent=" " * 10
    ) or [""]
    lines = [
        f"trace     {s.path}  ({s.size:,} bytes, format {s.version[0]}.{s.version[1]})",
        f"engine    {h.engine}" + (f"  model: {h.model}" if h.model else ""),
        f"recorded  {started:%Y-%m-%d %H:%M:%S} UTC on {h.host}"
        + ("  (prompts redacted)" if h.redacted else ""),
        f"config    {knobs[0]}",
        *knobs[1:],
        f"steps     {steps:,} ({s.first_step}..{s.last_step})  {when}{rate}",
        f"requests  {s.num_arrivals:,} arrived, {s.num_finishes:,} finished  "
        f"preemptions {s.num_preemptions:,}  snapshots {s.num_snapshots}",
        f"closed    {_closing(s)}",
    ]
    if s.segments:
        names = s.segments[0].name + ("" if len(s.segments) == 1 else f" .. {s.segments[-1].name}")
        lines.insert(1, f"segments  {len(s.segments)}: {names}")
    return printable("\n".join(lines))  # host, model, config values: from the file


def _closing(s: TraceSummary) -> str:
    if s.closed_cleanly and s.stopped:
        text = (
            "yes, but recording stopped before the engine did (it went on unrecorded): " + s.stopped
        )
        return "\n".join(textwrap.wrap(text, 88, subsequent_indent=" " * 10))
    if s.closed_cleanly:
        return "yes, cleanly (footer index present)"
    if s.cut is not None:
        where = f"{s.segments[-1].name} " if s.segments else ""
        text = (
            f"no: the tail {where}is cut at byte {s.cut.offset:,} ({s.cut.reason}); every "
            "record before it is whole"
        )
    else:
        text = (
            f"no: no footer (the writer is still running, or was killed between two "
            f"records); {s.end:,} bytes of whole records"
        )
    return "\n".join(textwrap.wrap(text, 88, subsequent_indent=" " * 10))
