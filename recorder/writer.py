"""The trace file writer: buffered, written inline or by a flusher thread, fsynced at close.

The engine's thread (or, with RecorderOptions(background=True), the recorder's encoding thread:
"the engine's thread" below means whichever appends) encodes and appends to a buffer.
A small flush (live mode: one step) is written inline while the disk is quick, which
costs less than waking a thread; a large one, or any flush after a slow write, goes to
a flusher thread, and the engine waits only if the flusher is still writing an earlier
batch and more than `max_backlog` bytes are queued. So a slow disk costs the engine at
most one flush.
If a write fails (disk full, say) recording stops with one warning and the engine goes
on: later records are dropped, the file keeps every record written whole before it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from recorder.errors import RecordingError
from recorder.framing import FRAME_SIZE, frame, frame_header, preamble

log = logging.getLogger("schedtop.recorder")

WriteFn = Callable[[int, memoryview], int]

INLINE_BYTES = 64 << 10  # flushes up to this size may be written by the engine's thread
SLOW_WRITE_S = 0.002  # a write slower than this sends the following ones to the flusher


class TraceWriter:
    """Appends framed records to a new trace file, from one thread (the engine's, or the
    recorder's encoding thread); after `share_with_timer`, the recorder's flush timer may
    flush it from another (`flush_buffered`): the appending side is then under a lock of
    its own, which the flusher thread never takes.

    Invariant: `offset` is the file offset the next record will have; `flushed` counts the
    bytes the OS has accepted, a prefix of the file that any reader can see."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        live: bool = True,
        flush_bytes: int = 1 << 20,
        flush_interval_s: float = 1.0,
        max_backlog: int = 16 << 20,
        write: WriteFn = os.write,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._fd = open_locked(self.path)
        self.live = live  # flush after every step record
        self.flush_bytes = flush_bytes  # otherwise flush when this much is buffered...
        self.flush_interval_s = flush_interval_s  # ...or this long after the last flush
        self.max_backlog = max_backlog  # queued bytes beyond which the engine waits
        self._write = write
        self._clock = clock  # times writes and flush intervals; tests pass their own
        # What is not flushed yet: the frames' parts, joined once at the flush (a growing
        # bytearray copied itself as it grew: 1 µs a record of a 1 KiB step).
        self._parts: list[bytes] = [preamble()]
        self._buffered = len(self._parts[0])  # their bytes
        self.offset = self._buffered
        self.flushed = 0
        self.error: str | None = None  # why recording stopped, once it has
        self._last_flush = self._clock()
        self._pending: list[bytes] = []
        self._backlog = 0
        self._busy = False  # the flusher is writing a batch
        self._last_write_s = 0.0  # how long the last write of INLINE_BYTES or less took
        self._closing = False
        self._closed = False
        # The appending side (the buffer, inline writes): the appender's thread and the
        # recorder's flush timer. Uncontended but for a timed flush: a lock costs the
        # appender well under a microsecond a record.
        self._side = threading.Lock()
        self._timed = False  # appends lock it too (share_with_timer)
        lock = threading.Lock()
        self._work = threading.Condition(lock)  # the flusher waits here for batches
        self._done = threading.Condition(lock)  # flush() and drain() wait here for writes
        self._thread = threading.Thread(target=self._run, name="trace-flusher", daemon=True)
        self._thread.start()

    def append(self, rtype: int, body: bytes, *, boundary: bool = False) -> int:
        """Buffer one record; returns its offset. `boundary` marks the end of a step, where
        live mode flushes."""
        if self._timed:
            with self._side:
                return self._append(rtype, body, boundary)
        return self._append(rtype, body, boundary)

    def _append(self, rtype: int, body: bytes, boundary: bool) -> int:
        if self.error is not None or self._closed:
            return self.offset
        start = self.offset
        header = frame_header(rtype, body)  # the body goes in uncopied: a step can be KBs
        parts = self._parts
        parts.append(header)
        parts.append(body)
        size = len(header) + len(body)
        self.offset += size
        self._buffered += size
        if boundary and (
            self.live
            or self._buffered >= self.flush_bytes
            or self._clock() - self._last_flush >= self.flush_interval_s
        ):
            self._flush()
        return start

    def share_with_timer(self) -> None:
        """From now on a flush timer on another thread may call `flush_buffered`: appends
        take the appending side's lock too (about 0.3 µs a record, so only then)."""
        self._timed = True

    def flush(self) -> None:
        """Write the buffer: inline when it is small, nothing is queued and the last write
        was quick (a page-cache write costs less than waking a thread); else hand it to
        the flusher thread, so that a slow disk never holds the engine again."""
        with self._side:
            self._flush()

    def since_write(self) -> float:
        """Seconds since the last flush (the recorder's flush timer wakes an interval
        after it)."""
        return self._clock() - self._last_flush

    def flush_buffered(self, min_age_s: float = 0.0) -> None:
        """`flush` if anything is buffered and nothing was written for `min_age_s`, from
        any thread: the recorder's flush timer, which writes out the steps of an engine
        that stopped stepping (and leaves the writes of one that steps to its thread)."""
        with self._side:
            if self._parts and not self._closed and self._clock() - self._last_flush >= min_age_s:
                self._flush()

    def _flush(self) -> None:
        now = self._last_flush = self._clock()
        if not self._parts:
            return
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts, self._buffered = [], 0
        # No lock needed to decide: only this (the engine's) thread queues batches. Once
        # the queue is seen empty the flusher cannot start a batch, so if it is then seen
        # idle it stays idle until we queue more. (Hence: the queue first, then _busy.)
        if (
            len(data) <= INLINE_BYTES
            and not self._pending
            and not self._busy
            and self._last_write_s < SLOW_WRITE_S
            and self.error is None
        ):
            error = self._write_all(data)
            self._last_write_s = self._clock() - now
            if error is not None:
                with self._done:
                    self._fail(error)
            return
        with self._done:
            # Wait for the flush in progress, never for more: it frees the whole backlog.
            while (
                self._busy and self._backlog + len(data) > self.max_backlog and self.error is None
            ):
                self._done.wait()
            if self.error is not None:
                return
            self._pending.append(data)
            self._backlog += len(data)
            self._work.notify()

    def drain(self) -> None:
        """Wait until everything flushed so far is written (or writing failed)."""
        self.flush()
        with self._done:
            while (self._pending or self._busy) and self.error is None:
                self._done.wait()

    def close(self) -> None:
        """Write what is left, fsync and close. Idempotent."""
        with self._side:
            if self._closed:
                return
            self._flush()
            self._closed = True  # from here on, appends and timed flushes do nothing
        with self._work:
            self._closing = True
            self._work.notify()
        self._thread.join()
        try:
            if self.error is None:
                os.fsync(self._fd)
        except OSError as e:
            self._fail(e)
        finally:
            os.close(self._fd)

    # -- the flusher thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._pending and not self._closing:
                    self._work.wait()
                if not self._pending:
                    return
                self._busy = True  # before the queue empties: flush() reads them unlocked
                batch, self._pending = self._pending, []
            data = batch[0] if len(batch) == 1 else b"".join(batch)
            start = self._clock()
            error = self._write_all(data)
            with self._done:
                self._busy = False
                self._last_write_s = (self._clock() - start) * min(
                    1.0, INLINE_BYTES / max(len(data), 1)
                )
                self._backlog -= len(data)
                if error is not None:
                    self._fail(error)
                    self._pending, self._backlog = [], 0
                self._done.notify_all()

    def _write_all(self, data: bytes) -> OSError | None:
        view = memoryview(data)
        try:
            while view:
                n = self._write(self._fd, view)
                self.flushed += n
                view = view[n:]
        except OSError as e:
            return e
        return None

    def _fail(self, error: OSError) -> None:
        if self.error is None:
            self.error = f"{self.path}: {error.strerror or error}"
            log.warning(
                "recording stopped: %s; the trace keeps every record written "
                "before this, and the engine goes on",
                self.error,
            )


def open_locked(path: Path) -> int:
    """Open `path` for writing, emptied, under an exclusive lock held until it is closed:
    two writers on one path would interleave their records into a file that reads as
    neither run. The lock is taken before the file is emptied, so a refused second writer
    leaves the first one's trace whole."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RecordingError(f"{path}: cannot create the trace: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pid = lock_holder(fd)
        os.close(fd)
        who = f"pid {pid}" if pid is not None else "another process"
        raise RecordingError(
            f"{path}: another writer ({who}) is recording this trace; choose another path"
        ) from None
    try:
        os.ftruncate(fd, 0)
    except OSError as e:
        os.close(fd)
        raise RecordingError(f"{path}: cannot empty the trace: {e.strerror}") from None
    return fd


def check_not_being_written(path: str | os.PathLike[str]) -> None:
    """Raise RecordingError when another process holds `path`'s writer lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return  # missing or unreadable: the output checks say what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pid = lock_holder(fd)
        who = f"pid {pid}" if pid is not None else "another process"
        raise RecordingError(
            f"{path}: another writer ({who}) is recording this trace; choose another path"
        ) from None
    finally:
        os.close(fd)


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd`, from /proc/locks (Linux); None
    where that cannot be told."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; blocked waiters ("->") skip
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


class TraceSink(Protocol):
    """Where a Recorder sends framed records: a file (TraceWriter) or memory."""

    offset: int  # the offset the next record gets
    flushed: int  # bytes a reader can see
    error: str | None  # why writing stopped, if it has

    def append(self, rtype: int, body: bytes, *, boundary: bool = False) -> int: ...

    def close(self) -> None: ...


class MemoryWriter:
    """A trace kept in memory (tests, benchmarks): `data` is a complete trace file."""

    def __init__(self) -> None:
        self.data = bytearray(preamble())
        self.offset = len(self.data)
        self.flushed = self.offset
        self.error: str | None = None

    def append(self, rtype: int, body: bytes, *, boundary: bool = False) -> int:
        start = self.offset
        self.data += frame(rtype, body)
        self.offset = self.flushed = len(self.data)
        return start

    def close(self) -> None:
        pass


class NullWriter:
    """A trace sink that keeps nothing: for runs that only want the records' side effects
    (a re-simulation checking its steps) without a file."""

    def __init__(self) -> None:
        self.offset = len(preamble())
        self.flushed = self.offset
        self.error: str | None = None

    def append(self, rtype: int, body: bytes, *, boundary: bool = False) -> int:
        start = self.offset
        self.offset = self.flushed = start + FRAME_SIZE + len(body)
        return start

    def close(self) -> None:
        pass
