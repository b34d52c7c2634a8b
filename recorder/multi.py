"""A run directory read as one trace: its segments end to end.

    reader = open_trace(path)      # a file: TraceReader; a run directory: SegmentedReader

Every command that reads a trace opens it through open_trace(), so each of them takes a
run directory too. A SegmentedReader is a TraceReader (same calls, same guarantees): the
header is the first kept segment's, steps continue across segments, the later segments'
headers and footers are left out and their snapshots kept. Offsets are virtual: segment
`i` (counted from the first kept one) holds offsets `i << 40` to `(i + 1) << 40`; errors
name the segment file and the offset inside it.

Segments are opened once and kept open, so a writer deleting old ones (rotation) does not
pull a segment from under a reader. A reader following a live run picks up new segments
as they appear: the writer creates the next segment before it closes the current one, so
a finished segment with no next one means the run is over.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from recorder.errors import TraceError
from recorder.paths import SUFFIX
from recorder.reader import Cut, Entry, Scan, TraceIndex, TraceReader
from recorder.schema import End, Footer, Record, RecordType, Step
from recorder.segments import SegmentFile, check_same_engine, is_run_dir, list_segments

_SHIFT = 40  # bits of a virtual offset that are the offset inside its segment
_MASK = (1 << _SHIFT) - 1


def open_trace(path: str | os.PathLike[str]) -> TraceReader:
    """A reader of the trace at `path`: a trace file, or a run directory of segments."""
    p = Path(path)
    if p.is_dir():
        return SegmentedReader(p)
    return TraceReader(p)


class SegmentedReader(TraceReader):
    """Reads the segments of a run directory as one trace."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory)
        found = list_segments(self.path)
        if not found:
            what = (
                "no such directory"
                if not self.path.exists()
                else "a directory without trace segments (segment-NNNNNN.trace) in it"
            )
            raise TraceError(what, incomplete=not self.path.exists()).at(self.path)
        self._segs: list[TraceReader] = []
        self._next_seq = found[0].seq
        self.cut = None
        self._unborn: Cut | None = None  # a last segment its writer died creating
        self._starting = False  # following: the next segment's header is not whole yet
        self.finished = False
        self._index: TraceIndex | None = None
        try:
            self._add_new(found, tail=False)
        except BaseException:
            self.close()
            raise
        if not self._segs:
            raise TraceError("the first segment has no header yet", incomplete=True).at(self.path)
        first = self._segs[0]
        self.version = first.version
        self.header = first.header
        self.records_start = first.records_start
        self.footer = self._combined_footer()
        self._tail = self.records_start
        self._last_tail_step: int | None = None

    @property
    def segments(self) -> list[Path]:
        """The segment files, oldest first."""
        return [s.path for s in self._segs]

    @property
    def size(self) -> int:
        """Bytes in the segments."""
        total = 0
        for s in self._segs:
            with contextlib.suppress(OSError):  # deleted by rotation since: still open here
                total += s.path.stat().st_size
        return total

    def close(self) -> None:
        for s in self._segs:
            s.close()

    # -- segments ----------------------------------------------------------------------------

    def _add_new(self, found: list[SegmentFile] | None = None, tail: bool = True) -> bool:
        """Open the segments written since the last look; False when there is none (and
        `_starting` says whether one is there, its header not yet whole)."""
        if found is None:
            found = list_segments(self.path)
        added = self._starting = False
        for seg in found:
            if seg.seq < self._next_seq:
                continue
            if seg.seq != self._next_seq and self._segs:
                raise TraceError(
                    f"segment {self._next_seq} is missing (the next one is {seg.seq})"
                ).at(self.path)
            try:
                reader = TraceReader(seg.path)
            except TraceError as e:
                if not self._segs and not seg.path.exists():
                    self._next_seq = seg.seq + 1  # rotation deleted it since the listing
                    continue
                if e.incomplete and seg is found[-1] and self._segs:
                    if not tail:  # the writer died creating it: the trace ends before it
                        where = self._virtual(len(self._segs), 0)
                        self._unborn = self.cut = Cut(where, f"{seg.path.name}: {e.message}")
                    self._starting = tail
                    return added  # (following: its writer is just starting it)
                e.path = str(seg.path)
                raise
            if self._segs:
                self._check_follows(reader)
            self._segs.append(reader)
            self._next_seq = seg.seq + 1
            added = True
        return added

    def _check_follows(self, reader: TraceReader) -> None:
        try:
            check_same_engine(reader, self._segs[0].header)
        except TraceError:
            reader.close()
            raise

    def _combined_footer(self) -> Footer | None:
        """A footer for the whole when every segment has one (the run ended cleanly)."""
        if self._unborn is not None or any(s.footer is None for s in self._segs):
            return None
        index = self.index()
        footers = [s.footer for s in self._segs if s.footer is not None]
        return Footer(
            first_step=index.first_step,
            step_offsets=tuple(index.step_offsets),
            snapshot_steps=tuple(index.snapshot_steps),
            snapshot_offsets=tuple(index.snapshot_offsets),
            num_steps=sum(f.num_steps for f in footers),
            num_arrivals=sum(f.num_arrivals for f in footers),
            num_finishes=sum(f.num_finishes for f in footers),
            num_preemptions=sum(f.num_preemptions for f in footers),
            end_time_ns=footers[-1].end_time_ns,
        )

    def _cut_at(self, seg: TraceReader) -> None:
        """Report a segment's cut (only the last can have one: the others are whole)."""
        self.cut = seg.cut if seg.cut is not None or seg is not self._segs[-1] else self._unborn

    def _locate(self, offset: int) -> tuple[int, TraceReader, int]:
        i = offset >> _SHIFT
        if not 0 <= i < len(self._segs):
            raise TraceError("no segment holds this offset", offset).at(self.path)
        return i, self._segs[i], offset & _MASK

    @staticmethod
    def _virtual(i: int, offset: int) -> int:
        return (i << _SHIFT) | offset

    # -- reading -------------------------------------------------------------------------------

    def entries(self, start: int | None = None) -> Iterator[Entry]:
        i, seg, local = self._locate(self.records_start if start is None else start)
        last_step: int | None = None
        while True:
            last = i == len(self._segs) - 1
            for entry in seg.entries(local):
                record = entry.record
                if isinstance(record, Footer | End) and not last:
                    continue
                if isinstance(record, Step):
                    if last_step is not None and record.step != last_step + 1:
                        raise TraceError(
                            f"step {record.step} follows step {last_step}", entry.offset
                        ).at(seg.path)
                    last_step = record.step
                yield Entry(self._virtual(i, entry.offset), record)
            self._cut_at(seg)
            if last:
                self.finished = seg.finished
                return
            i += 1  # (whether the next one continues this one is checked below)
            seg = self._segs[i]
            local = seg.records_start
            self._check_first_step(seg, last_step)

    def frames(
        self, start: int | None = None, tail: bool = False
    ) -> Iterator[tuple[int, int, bytes]]:
        """As one file's: a segment's END is passed over while another segment follows it
        (the writer starts the next segment before it ends the last one)."""
        i, seg, local = self._locate(self.records_start if start is None else start)
        while True:
            for offset, rtype, body in seg.frames(local, tail=tail):
                if rtype == RecordType.END and (i < len(self._segs) - 1 or self._add_new()):
                    break
                yield self._virtual(i, offset), rtype, body
            if i == len(self._segs) - 1:
                return
            i += 1
            seg, local = self._segs[i], self._segs[i].records_start

    def read_at(self, offset: int) -> Entry:
        return Entry(offset, self.record_at(offset))

    def record_at(self, offset: int) -> Record:
        i, seg, local = self._locate(offset)
        try:
            return seg.record_at(local)
        except TraceError as e:
            e.path = str(seg.path)
            raise

    def index(self) -> TraceIndex:
        if self._index is None:
            steps: list[int] = []
            snap_steps: list[int] = []
            snap_offsets: list[int] = []
            next_step = self.header.first_step
            for i, seg in enumerate(self._segs):
                idx = seg.index()
                if idx.first_step != next_step:
                    self._check_first_step(seg, next_step - 1)
                steps += (self._virtual(i, o) for o in idx.step_offsets)
                snap_steps += idx.snapshot_steps
                snap_offsets += (self._virtual(i, o) for o in idx.snapshot_offsets)
                next_step = idx.last_step + 1
                self._cut_at(seg)
            self._index = TraceIndex(self.header.first_step, steps, snap_steps, snap_offsets)
        return self._index

    def scan(self, start: int, next_step: int, tail: bool = False) -> Scan:
        i, seg, local = self._locate(start)
        steps: list[int] = []
        snap_steps: list[int] = []
        snap_offsets: list[int] = []
        while True:
            found = seg.scan(local, next_step, tail=tail)
            steps += (self._virtual(i, o) for o in found.step_offsets)
            snap_steps += found.snapshot_steps
            snap_offsets += (self._virtual(i, o) for o in found.snapshot_offsets)
            next_step += len(found.step_offsets)
            end = self._virtual(i, found.end)
            self._cut_at(seg)
            if not found.finished:
                return Scan(steps, snap_steps, snap_offsets, end, False)
            if i == len(self._segs) - 1 and not (tail and self._add_new()):
                return Scan(steps, snap_steps, snap_offsets, end, not self._starting)
            i += 1
            seg = self._segs[i]
            local = seg.records_start
            self._check_first_step(seg, next_step - 1)

    def poll(self) -> list[Entry]:
        out: list[Entry] = []
        while not self.finished:
            i, seg, _ = self._locate(self._tail)
            got = seg.poll()
            for entry in got:
                if isinstance(entry.record, Footer | End):
                    continue  # the next segment, or the end, decides
                out.append(Entry(self._virtual(i, entry.offset), entry.record))
            if seg.finished:
                if i == len(self._segs) - 1 and not self._add_new():
                    self.finished = not self._starting
                    break
                self._tail = self._virtual(i + 1, self._segs[i + 1].records_start)
                continue
            if not got:
                break
        return out

    def _check_first_step(self, seg: TraceReader, last_step: int | None) -> None:
        expected = seg.header.first_step if last_step is None else last_step + 1
        if seg.header.first_step != expected:
            what = "a segment is missing" if seg.header.first_step > expected else "overlap"
            raise TraceError(
                f"this segment starts at step {seg.header.first_step}, the one before it "
                f"ends at step {expected - 1} ({what})"
            ).at(seg.path)


def traces_in(directory: Path) -> list[Path]:
    """Trace files and run directories in `directory`, newest first (by name)."""
    try:
        children = list(directory.iterdir())
    except OSError:
        return []
    found = [
        p
        for p in children
        if (p.name.endswith(SUFFIX) and p.is_file()) or (p.is_dir() and is_run_dir(p))
    ]
    return sorted(found, key=lambda p: p.name, reverse=True)
