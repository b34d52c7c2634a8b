"""A recording kept as rotating segments: one directory per run, one trace file per
segment, named so that names sort in recording order.

    20261201-054300.123-serve-4242/        one server run (recorder.paths.new_run_dir)
        segment-000000.trace               steps 0..k (a whole trace file)
        segment-000001.trace               header, snapshot of step k, steps k+1.. (...)
        incidents/incident-....trace       extracted by ServerRecording.incident()

Every segment is a trace of its own (docs/trace-format.md, section 11); put end to end
they are one trace. This module names and lists them; `recorder.multi` reads a directory
as one trace.
"""

from __future__ import annotations

import dataclasses
import os
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from recorder.codec import MAX_RECORD_BYTES, decode, encode
from recorder.errors import RecordingError, TraceError
from recorder.framing import frame, preamble
from recorder.paths import SUFFIX
from recorder.reader import TraceReader
from recorder.schema import End, Footer, Header, RecordType, Step

SEGMENT_PREFIX = "segment-"
INCIDENTS = "incidents"  # the sub-directory incident files go to
_SEGMENT = re.compile(re.escape(SEGMENT_PREFIX) + r"(\d{6,})" + re.escape(SUFFIX) + "$")


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """One segment of a run directory."""

    seq: int  # its number: 0 for the first segment of a run, then 1, 2, ...
    path: Path  # the file


def segment_name(seq: int) -> str:
    """The file name of segment `seq`: `segment-000042.trace`."""
    return f"{SEGMENT_PREFIX}{seq:06d}{SUFFIX}"


def list_segments(directory: Path) -> list[SegmentFile]:
    """The segments in `directory`, oldest first ([] when there are none, or it is not a
    readable directory)."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return []
    found = []
    for name in names:
        m = _SEGMENT.match(name)
        if m is not None:
            found.append(SegmentFile(int(m.group(1)), directory / name))
    found.sort(key=lambda s: s.seq)
    return found


def is_run_dir(path: Path) -> bool:
    """Whether `path` is a directory of segments."""
    return path.is_dir() and bool(list_segments(path))


@dataclass(frozen=True, slots=True)
class Joined:
    """What join() wrote."""

    path: Path  # the trace file
    first_step: int  # its first step
    last_step: int  # its last step (first_step - 1: none)
    size: int  # bytes


def join(readers: Sequence[TraceReader], out: Path, since_ns: int | None = None) -> Joined:
    """Write consecutive segments as one trace file at `out`: the first one's header,
    every record of each segment (its snapshots included) in order, and a footer. Records
    are copied as they are, not decoded again. With `since_ns` (the recording's clock),
    the first segment is cut at a step boundary: the output starts at its last snapshot
    taken before a step later than `since_ns` (a trace needs a state to start from), so
    that an incident is not a whole segment older than asked for. The file appears whole
    or not at all (it is written under a temporary name and renamed). Raises TraceError
    when the segments do not follow each other, RecordingError when `out` cannot be
    written."""
    if not readers:
        raise ValueError("join() needs at least one segment")
    part = out.with_name(out.name + ".part")
    try:
        f = open(part, "wb")  # noqa: SIM115 -- closed below, renamed only when whole
    except OSError as e:
        raise RecordingError(f"{out}: cannot write the trace: {e.strerror}") from None
    try:
        with f:
            joined = _Joiner(f, readers).run(out, since_ns)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, out)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise RecordingError(f"{out}: cannot write the trace: {e.strerror}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return joined


class _Joiner:
    """One join: copies frames, keeps the footer's index and totals."""

    def __init__(self, f: BinaryIO, readers: Sequence[TraceReader]) -> None:
        self.f = f
        self.readers = readers
        self.offset = 0
        self.step_offsets = array("Q")
        self.snapshots: list[tuple[int, int]] = []
        self.counts = [0, 0, 0]  # arrivals, finishes, preemptions
        self.end_time_ns = 0

    def run(self, out: Path, since_ns: int | None = None) -> Joined:
        first = self.readers[0]
        start, next_step = (None, first.header.first_step)
        if since_ns is not None:
            start, next_step = _cut_point(first, since_ns)
        header = dataclasses.replace(first.header, first_step=next_step)
        self._write(preamble(*first.version))
        self._frame(*encode(header))
        for i, reader in enumerate(self.readers):
            if i == 0:
                next_step = self._copy(reader, next_step, start)
                continue
            _check_follows(reader, first.header, next_step)
            next_step = self._copy(reader, next_step)
        offsets = tuple(self.step_offsets)
        if len(offsets) * 8 > MAX_RECORD_BYTES // 2:
            offsets = ()  # too many to index: readers scan instead
        footer = Footer(
            first_step=header.first_step,
            step_offsets=offsets,
            snapshot_steps=tuple(s for s, _ in self.snapshots),
            snapshot_offsets=tuple(o for _, o in self.snapshots),
            num_steps=len(self.step_offsets),
            num_arrivals=self.counts[0],
            num_finishes=self.counts[1],
            num_preemptions=self.counts[2],
            end_time_ns=self.end_time_ns,
        )
        at = self._frame(*encode(footer))
        self._frame(*encode(End(at)))
        return Joined(out, header.first_step, next_step - 1, self.offset)

    def _copy(self, reader: TraceReader, next_step: int, start: int | None = None) -> int:
        """Copy one segment's records (from the record at `start`: then its footer's
        totals are not the copy's); returns the step after its last."""
        footer = reader.footer if start is None else None
        last: bytes | None = None
        for _, rtype, body in reader.frames(start):
            if rtype == RecordType.STEP:
                self.step_offsets.append(self._frame(rtype, body))
                next_step += 1
                last = body
                if footer is None:
                    self._count(body)
            elif rtype == RecordType.SNAPSHOT:
                self.snapshots.append((next_step - 1, self._frame(rtype, body)))
            elif rtype not in (RecordType.HEADER, RecordType.FOOTER, RecordType.END):
                self._frame(rtype, body)  # a type this version does not know: kept
        if footer is not None:
            self.counts[0] += footer.num_arrivals
            self.counts[1] += footer.num_finishes
            self.counts[2] += footer.num_preemptions
            self.end_time_ns = footer.end_time_ns
        elif last is not None:
            self.end_time_ns = self._decode_step(last).time_ns
        return next_step

    def _count(self, body: bytes) -> None:
        step = self._decode_step(body)
        self.counts[0] += len(step.arrivals)
        self.counts[1] += len(step.finishes)
        self.counts[2] += len(step.preemptions)

    @staticmethod
    def _decode_step(body: bytes) -> Step:
        step = decode(RecordType.STEP, body, 0)
        assert isinstance(step, Step)
        return step

    def _frame(self, rtype: int, body: bytes) -> int:
        at = self.offset
        self._write(frame(rtype, body))
        return at

    def _write(self, data: bytes) -> None:
        self.f.write(data)
        self.offset += len(data)


def _cut_point(reader: TraceReader, since_ns: int) -> tuple[int | None, int]:
    """Where to start copying `reader` for a window from `since_ns`: (the offset of the
    last snapshot before the first step later than `since_ns`, the step after that
    snapshot); (None, its first step) when that is its opening snapshot."""
    step = reader.header.first_step
    best: tuple[int | None, int] = (None, step)
    seen_step = False
    for offset, rtype, body in reader.frames():
        if rtype == RecordType.STEP:
            if _Joiner._decode_step(body).time_ns > since_ns:
                break
            step += 1
            seen_step = True
        elif rtype == RecordType.SNAPSHOT and seen_step:
            best = (offset, step)
    return best


def check_same_engine(reader: TraceReader, first: Header) -> None:
    """A segment must come from the engine that recorded the first: same configuration."""
    h = reader.header
    if (h.config, h.block_size, h.num_blocks, h.policy, h.redacted) != (
        first.config,
        first.block_size,
        first.num_blocks,
        first.policy,
        first.redacted,
    ):
        raise TraceError(
            "this segment was recorded with another engine configuration than the first",
        ).at(reader.path)


def _check_follows(reader: TraceReader, first: Header, next_step: int) -> None:
    """A segment must continue the recording of the first: same engine, next step."""
    check_same_engine(reader, first)
    h = reader.header
    if h.first_step != next_step:
        missing = "a segment is missing" if h.first_step > next_step else "segments overlap"
        raise TraceError(
            f"this segment starts at step {h.first_step}, the one before it ends at step "
            f"{next_step - 1} ({missing})"
        ).at(reader.path)
