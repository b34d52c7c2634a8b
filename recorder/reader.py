"""The one trace reader: iterate, seek by step, survive a cut tail, follow a growing file.

Every problem with the file raises TraceError naming the byte offset; nothing else comes
out of a reader, whatever the bytes. A file whose writer died mid-record is not an error:
the reader stops after the last whole record and says where the tail was cut (`cut`).
"""

from __future__ import annotations

import io
import os
import stat
import time
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from recorder.codec import END_BODY_SIZE, MAX_RECORD_BYTES, decode
from recorder.errors import TraceError
from recorder.framing import (
    END_RECORD_SIZE,
    FRAME,
    FRAME_SIZE,
    MAGIC,
    PREAMBLE,
    PREAMBLE_SIZE,
    checksum,
)
from recorder.schema import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    End,
    Footer,
    Header,
    Record,
    RecordType,
    Snapshot,
    Step,
)


@dataclass(frozen=True, slots=True)
class Entry:
    """A record and where it starts in the file."""

    offset: int  # byte offset of the record's frame
    record: Record  # the decoded record


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a file stops being whole: its writer died while writing this record."""

    offset: int  # first byte of the incomplete record
    reason: str  # what is missing


@dataclass(frozen=True, slots=True)
class TraceIndex:
    """Where each step record and snapshot is."""

    first_step: int  # the step of step_offsets[0]
    step_offsets: Sequence[int]  # byte offset of each step record, in step order
    snapshot_steps: Sequence[int]  # the step each snapshot follows, ascending
    snapshot_offsets: Sequence[int]  # byte offset of each snapshot

    @property
    def last_step(self) -> int:
        """The last step in the trace (first_step - 1 when there is none)."""
        return self.first_step + len(self.step_offsets) - 1


@dataclass(frozen=True, slots=True)
class Scan:
    """What one scan of a stretch of the file found."""

    step_offsets: list[int]  # byte offset of each step record found, in order
    snapshot_steps: list[int]  # the step each snapshot found follows
    snapshot_offsets: list[int]  # byte offset of each snapshot found
    end: int  # where the scan stopped: the end of the last whole record it read
    finished: bool  # it reached the END record


@dataclass(frozen=True, slots=True)
class Seek:
    """How to reach a step: start from `snapshot` (None: the initial state), then apply
    `steps`, which ends with the step asked for."""

    snapshot: Snapshot | None  # the nearest snapshot at or before the step
    steps: Iterator[Entry]  # the step records after it, up to the step, with offsets


_Frame = tuple[int, bytes, int]  # type tag, body, offset of the next record
SCANNED_BYTES = 4 << 20  # step bodies a tail scan keeps for read_at, at most


class TraceReader:
    """Reads one trace file. Opening reads the preamble, the header and (when the file
    was closed cleanly) the footer; records are read on demand.

    Use as a context manager, or call close()."""

    def __init__(self, path: str | os.PathLike[str], *, _file: BinaryIO | None = None) -> None:
        self.path = Path(path)
        try:
            self._f = _open(self.path) if _file is None else _file
        except TraceError as e:
            e.path = str(self.path)
            raise
        self.cut: Cut | None = None  # set once a read reaches an incomplete last record
        self.finished = False  # set once a read reaches the END record
        try:
            self.version = self._read_preamble()
            self.header = self._read_header()
            self.footer = self._read_footer()
        except TraceError as e:
            self._f.close()
            e.path = str(self.path)
            raise
        except BaseException:
            self._f.close()
            raise
        self._index: TraceIndex | None = None
        self._tail = self.records_start
        self._head: bytes | None = None  # preamble and header as first read (tail mode checks)
        if _file is None:
            self._head = os.pread(self._f.fileno(), self.records_start, 0)
        self._last_tail_step: int | None = None
        # Step frames a tail scan read and checked, by offset, until read_at takes them:
        # a view following a growing file reads each new step right after indexing it,
        # and would otherwise read and checksum it a second time. Bounded in bytes.
        self._scanned: OrderedDict[int, _Frame] = OrderedDict()
        self._scanned_bytes = 0

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<memory>") -> TraceReader:
        """Read a trace held in memory."""
        return cls(name, _file=io.BytesIO(data))

    @classmethod
    def wait_for(
        cls, path: str | os.PathLike[str], timeout_s: float, poll_s: float = 0.05
    ) -> TraceReader:
        """Open a trace that a writer may not have started yet, waiting up to `timeout_s`
        for the file and its header to appear."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(path)
            except TraceError as e:
                if not e.incomplete or time.monotonic() >= deadline:
                    raise
            time.sleep(poll_s)

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    @property
    def closed_cleanly(self) -> bool:
        """Whether the writer closed the trace (it has a footer)."""
        return self.footer is not None

    # -- reading records --------------------------------------------------------------------

    def entries(self, start: int | None = None) -> Iterator[Entry]:
        """Every record from `start` (default: the first after the header) to the end,
        skipping record types this reader does not know. Stops at an incomplete last
        record, which it reports in `cut`."""
        offset = self.records_start if start is None else start
        last_step: int | None = None
        while True:
            frame = self._frame_at(offset)
            if frame is None:
                return
            rtype, body, after = frame
            record = decode(rtype, body, offset)
            if record is not None:
                last_step = self._check_order(record, offset, last_step)
                yield Entry(offset, record)
                if isinstance(record, End):
                    self.finished = True
                    return
            offset = after

    def frames(
        self, start: int | None = None, tail: bool = False
    ) -> Iterator[tuple[int, int, bytes]]:
        """Every whole record from `start` (default: the first after the header) as
        (offset, type, body), checksummed but not decoded: for a scan that needs a few
        fields of each record. Ends with the END record (yielded, so that a scan knows the
        trace is complete) or at an incomplete last record (reported in `cut` unless
        `tail`: the file is still being written)."""
        offset = self.records_start if start is None else start
        while (frame := self._frame_at(offset, tail)) is not None:
            rtype, body, after = frame
            yield offset, rtype, body
            if rtype == RecordType.END:
                return
            offset = after

    def steps(self, start: int | None = None) -> Iterator[Step]:
        """The step records from `start`, in order."""
        for entry in self.entries(start):
            if isinstance(entry.record, Step):
                yield entry.record

    def records_of(
        self, rtype: int, start: int | None = None, tail: bool = False
    ) -> tuple[list[Entry], int]:
        """The whole records of type `rtype` from byte `start` on (default: the first after
        the header), decoding no others, and where the last whole record ends (the next
        call's `start` when following a growing file with `tail`). The bodies of the
        other records are passed over unread (their checksums are left to the readers
        that decode them): a live view looks for CLIENT records between every batch of
        steps, which it reads and checks once already."""
        offset = self.records_start if start is None else start
        out: list[Entry] = []
        f = self._f
        size = os.fstat(f.fileno()).st_size
        while True:
            f.seek(offset)
            head = f.read(FRAME_SIZE)
            if len(head) == FRAME_SIZE:
                length, kind, _ = FRAME.unpack(head)
                after = offset + FRAME_SIZE + length
                if kind not in (rtype, RecordType.END, 0) and after <= size:
                    offset = after  # (its length and checksum: for the readers that decode it)
                    continue
            frame = self._frame_at(offset, tail=tail)  # checks it, or finds where it is cut
            if frame is None:
                break
            kind, body, after = frame
            if kind == rtype:
                record = decode(kind, body, offset)
                if record is not None:
                    out.append(Entry(offset, record))
            offset = after
            if kind == RecordType.END:
                self.finished = True
                break
        return out, offset

    def _keep_scanned(self, offset: int, frame: _Frame) -> None:
        self._scanned[offset] = frame
        self._scanned_bytes += len(frame[1])
        while self._scanned_bytes > SCANNED_BYTES:
            _, (_, body, _) = self._scanned.popitem(last=False)
            self._scanned_bytes -= len(body)

    def read_at(self, offset: int) -> Entry:
        """The record at `offset` (a record start, from the index)."""
        return Entry(offset, self.record_at(offset))

    def record_at(self, offset: int) -> Record:
        """read_at(offset).record, without the Entry (a live view reads thousands of
        records a second, and a frozen dataclass costs a microsecond to build)."""
        frame = self._scanned.pop(offset, None) if self._scanned else None
        if frame is not None:
            self._scanned_bytes -= len(frame[1])
        else:
            frame = self._frame_at(offset)
        if frame is None:
            raise TraceError("no whole record here", offset)
        rtype, body, _ = frame
        record = decode(rtype, body, offset)
        if record is None:
            raise TraceError(f"record of unknown type {rtype}", offset)
        return record

    # -- the index and seeking -----------------------------------------------------------------

    def index(self) -> TraceIndex:
        """Step and snapshot offsets: from the footer, or by scanning the file once."""
        if self._index is None:
            footer = self.footer
            if footer is not None and len(footer.step_offsets) == footer.num_steps:
                self._index = TraceIndex(
                    footer.first_step,
                    footer.step_offsets,
                    footer.snapshot_steps,
                    footer.snapshot_offsets,
                )
            else:
                self._index = self._scan()
        return self._index

    def seek(self, step: int) -> Seek:
        """The nearest snapshot at or before `step` and the step records from there."""
        index = self.index()
        if not index.first_step <= step <= index.last_step:
            raise ValueError(
                f"step {step} is not in this trace ({index.first_step}..{index.last_step})"
            )
        i = bisect_right(index.snapshot_steps, step) - 1
        snapshot: Snapshot | None = None
        start_step = index.first_step
        if i >= 0:
            entry = self.read_at(index.snapshot_offsets[i])
            if (
                not isinstance(entry.record, Snapshot)
                or entry.record.step != index.snapshot_steps[i]
            ):
                raise TraceError(
                    f"the index says a snapshot of step {index.snapshot_steps[i]} is here",
                    entry.offset,
                )
            snapshot = entry.record
            start_step = snapshot.step + 1
        elif index.first_step != 0:
            raise TraceError(
                "the trace starts mid-run but has no snapshot before its first step",
                self.records_start,
            )
        return Seek(snapshot, self._steps_between(index, start_step, step))

    def _steps_between(self, index: TraceIndex, first: int, last: int) -> Iterator[Entry]:
        if first > last:
            return
        offset = index.step_offsets[first - index.first_step]
        expected = first
        for entry in self.entries(offset):
            step = entry.record
            if not isinstance(step, Step):
                continue
            if step.step != expected:
                raise TraceError(
                    f"step {step.step} where the index has step {expected}", entry.offset
                )
            yield entry
            if expected == last:
                return
            expected += 1
        raise TraceError(f"step {expected} is missing", offset)

    def _scan(self) -> TraceIndex:
        """Index a file without a footer: frame headers and checksums only, no decoding."""
        found = self.scan(self.records_start, self.header.first_step)
        return TraceIndex(
            self.header.first_step, found.step_offsets, found.snapshot_steps, found.snapshot_offsets
        )

    def scan(self, start: int, next_step: int, tail: bool = False) -> Scan:
        """Index the whole records from byte `start` on (frames and checksums only, no
        decoding), where the first step record found is step `next_step`. With `tail`
        (a file still being written), an incomplete last record is left for a later scan
        instead of being reported as a cut."""
        steps: list[int] = []
        snap_steps: list[int] = []
        snap_offsets: list[int] = []
        if tail:
            self.check_unchanged(start)
        offset = start
        finished = False
        while (frame := self._frame_at(offset, tail=tail)) is not None:
            rtype, _, after = frame
            if rtype == RecordType.STEP:
                steps.append(offset)
                if tail:
                    self._keep_scanned(offset, frame)
            elif rtype == RecordType.SNAPSHOT:
                snap_steps.append(next_step + len(steps) - 1)
                snap_offsets.append(offset)
            elif rtype == RecordType.END:
                finished = True
                break
            offset = after
        return Scan(steps, snap_steps, snap_offsets, offset, finished)

    # -- tail mode ---------------------------------------------------------------------------

    def check_unchanged(self, read_up_to: int) -> None:
        """Raise TraceError when the file is no longer the one opened: truncated below
        `read_up_to` (bytes already read), replaced at its path, or rewritten from the
        start by a new run (its preamble and header differ). A follower would otherwise
        wait at an old offset forever, or read the new run's records as the old one's."""
        if self._head is None:
            return  # a trace in memory cannot change
        st = os.fstat(self._f.fileno())
        why = None
        if st.st_size < read_up_to:
            why = f"it was truncated to {st.st_size} bytes"
        else:
            try:
                now = os.stat(self.path)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    why = "another file replaced it"
            except OSError:
                why = "it was removed"
            if why is None and os.pread(self._f.fileno(), len(self._head), 0) != self._head:
                why = "a new run rewrote it"
        if why is not None:
            err = TraceError(f"the trace changed under the reader: {why}; open it again")
            err.path = str(self.path)
            raise err

    def poll(self) -> list[Entry]:
        """The whole records appended since the last poll (tail mode): an incomplete last
        record is left for the next poll, not reported as a cut."""
        out: list[Entry] = []
        if not self.finished:
            self.check_unchanged(self._tail)
        while not self.finished:
            frame = self._frame_at(self._tail, tail=True)
            if frame is None:
                break
            rtype, body, after = frame
            record = decode(rtype, body, self._tail)
            if record is not None:
                self._last_tail_step = self._check_order(record, self._tail, self._last_tail_step)
                out.append(Entry(self._tail, record))
                self.finished = isinstance(record, End)
            self._tail = after
        return out

    def follow(
        self,
        poll_s: float = 0.05,
        idle_timeout_s: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[Entry]:
        """Records as a writer appends them, until the END record, until `stop()` is true,
        or until nothing new has come for `idle_timeout_s`."""
        idle_since = time.monotonic()
        while not self.finished and not (stop is not None and stop()):
            entries = self.poll()
            if entries:
                idle_since = time.monotonic()
                yield from entries
                continue
            if idle_timeout_s is not None and time.monotonic() - idle_since >= idle_timeout_s:
                return
            time.sleep(poll_s)

    # -- frames -----------------------------------------------------------------------------

    def _frame_at(self, offset: int, tail: bool = False) -> _Frame | None:
        """The frame at `offset`, or None at the end of the file (recording a cut when the
        file ends inside a record, unless `tail`: the writer may still be writing it)."""
        f = self._f
        f.seek(offset)
        head = f.read(FRAME_SIZE)
        if len(head) < FRAME_SIZE:
            if head and not tail:
                self._set_cut(offset, f"frame header cut after {len(head)} of {FRAME_SIZE} bytes")
            return None
        length, rtype, crc = FRAME.unpack(head)
        if rtype == 0:
            raise TraceError("invalid record type 0", offset)
        if length > MAX_RECORD_BYTES:
            raise TraceError(
                f"record length {length} exceeds the limit of {MAX_RECORD_BYTES} bytes", offset
            )
        body = f.read(length)
        if len(body) < length:
            if not tail:
                self._set_cut(offset, f"record cut after {len(body)} of {length} body bytes")
            return None
        if checksum(rtype, body) != crc:
            raise TraceError(f"checksum mismatch in a record of type {rtype}: corrupt data", offset)
        return rtype, body, offset + FRAME_SIZE + length

    def _set_cut(self, offset: int, reason: str) -> None:
        self.cut = Cut(offset, reason)

    @staticmethod
    def _check_order(record: Record, offset: int, last_step: int | None) -> int | None:
        if isinstance(record, Step):
            if last_step is not None and record.step != last_step + 1:
                raise TraceError(f"step {record.step} follows step {last_step}", offset)
            return record.step
        if isinstance(record, Header):
            raise TraceError("a second header record", offset)
        return last_step

    # -- opening ------------------------------------------------------------------------------

    def _read_preamble(self) -> tuple[int, int]:
        data = self._f.read(PREAMBLE_SIZE)
        if len(data) < PREAMBLE_SIZE:
            incomplete = MAGIC.startswith(data[: len(MAGIC)])
            raise TraceError(f"not a schedtop trace: only {len(data)} bytes", incomplete=incomplete)
        magic, major, minor = PREAMBLE.unpack(data)
        if magic != MAGIC:
            raise TraceError("not a schedtop trace (wrong magic bytes)", 0)
        if major > FORMAT_MAJOR:
            raise TraceError(
                f"trace format {major}.{minor} is newer than this "
                f"schedtop reads ({FORMAT_MAJOR}.{FORMAT_MINOR}); upgrade schedtop "
                "to read it",
                len(MAGIC),
            )
        if major < 1:
            raise TraceError(f"unknown trace format {major}.{minor}", len(MAGIC))
        return major, minor

    def _read_header(self) -> Header:
        frame = self._frame_at(PREAMBLE_SIZE)
        if frame is None:
            raise TraceError("the header record is incomplete", PREAMBLE_SIZE, incomplete=True)
        rtype, body, after = frame
        record = decode(rtype, body, PREAMBLE_SIZE)
        if not isinstance(record, Header):
            raise TraceError("the first record is not a header", PREAMBLE_SIZE)
        self.records_start = after
        return record

    def _read_footer(self) -> Footer | None:
        size = self._f.seek(0, os.SEEK_END)
        end_at = size - END_RECORD_SIZE
        if end_at < self.records_start:
            return None
        self._f.seek(end_at)
        head = self._f.read(END_RECORD_SIZE)
        length, rtype, crc = FRAME.unpack_from(head)
        if (
            rtype != RecordType.END
            or length != END_BODY_SIZE
            or checksum(rtype, head[FRAME_SIZE:]) != crc
        ):
            return None  # not closed cleanly: readers scan
        end = decode(rtype, head[FRAME_SIZE:], end_at)
        assert isinstance(end, End)
        if not self.records_start <= end.footer_offset < end_at:
            raise TraceError(f"the footer offset {end.footer_offset} is outside the file", end_at)
        frame = self._frame_at(end.footer_offset)
        if frame is None or frame[2] != end_at or frame[0] != RecordType.FOOTER:
            raise TraceError("the END record does not point at a footer", end.footer_offset)
        footer = decode(frame[0], frame[1], end.footer_offset)
        assert isinstance(footer, Footer)
        _check_footer(footer, self.header, end.footer_offset)
        return footer


def _check_footer(footer: Footer, header: Header, offset: int) -> None:
    if footer.first_step != header.first_step:
        raise TraceError(
            f"footer: first step {footer.first_step}, header: {header.first_step}", offset
        )
    if len(footer.snapshot_steps) != len(footer.snapshot_offsets):
        raise TraceError("footer: snapshot steps and offsets differ in number", offset)
    if footer.step_offsets and len(footer.step_offsets) != footer.num_steps:
        raise TraceError(
            f"footer: {len(footer.step_offsets)} step offsets for {footer.num_steps} steps", offset
        )
    for offsets in (footer.step_offsets, footer.snapshot_offsets):
        if offsets and offsets[-1] >= offset:
            raise TraceError("footer: an offset points past the footer", offset)
    if any(b < a for a, b in zip(footer.snapshot_steps, footer.snapshot_steps[1:])):
        raise TraceError("footer: snapshot steps are not in order", offset)


def _open(path: Path) -> BinaryIO:
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise TraceError("not a regular file")
        return _File(path)
    except FileNotFoundError:
        raise TraceError("no such file", incomplete=True) from None
    except OSError as e:
        raise TraceError(f"cannot read: {e.strerror}") from None


class _File(io.BufferedReader):
    """A trace file whose read errors (EIO on a failing disk, /proc/self/mem) are
    TraceErrors naming the file, like every other way a trace cannot be read."""

    def __init__(self, path: Path) -> None:
        super().__init__(io.FileIO(path, "r"), buffer_size=1 << 16)
        self._path = str(path)

    def read(self, size: int | None = -1) -> bytes:
        try:
            return super().read(size)
        except OSError as e:
            err = TraceError(f"cannot read: {e.strerror or e}")
            err.path = self._path
            raise err from None
