"""The live stream viewers attach to: a trace in its own framing, fanned out to several
readers that come and go, none of which can slow the engine or grow its memory.

A viewer's stream is a trace that starts mid-run: the preamble, a HEADER whose
first_step is the next step, the SNAPSHOT of the state before it, then every STEP record
(and periodic SNAPSHOT) as the recorder writes it. Each subscription queues at most
`limit` bytes; when a record does not fit, its queue is emptied and, at the next point
between two steps, it gets a fresh HEADER and SNAPSHOT (a *resync*: the reader rebuilds
its state from the snapshot). One that has taken nothing since its last resync when it
overflows again is dropped: its stream ends. docs/trace-format.md, section 12, has the rule.

Threads: the engine thread publishes and serves resyncs; any other thread subscribes,
reads (`get`) and closes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

CHUNK_BYTES = 256 << 10  # get() joins queued records up to about this much
DEFAULT_LIMIT = 4 << 20  # bytes one viewer may have queued
DEFAULT_MAX_VIEWERS = 16

_PENDING, _LIVE, _RESYNC = 0, 1, 2  # waiting for its first snapshot / streaming / behind


class TooManyViewers(RuntimeError):
    """subscribe() while the most viewers the recording serves are attached."""


class StreamSubscription:
    """One viewer's stream. `get()` and `close()` may be called from any thread."""

    def __init__(self, hub: StreamHub, limit: int) -> None:
        self._hub = hub
        self._limit = limit
        self._cond = threading.Condition(threading.Lock())
        self._chunks: deque[bytes] = deque()
        self.buffered = 0  # bytes queued and not yet taken: never more than `limit`
        self.skips = 0  # times it fell behind and was resynced
        self.dropped = False  # it fell behind twice without reading: its stream ended
        self._state = _PENDING
        self._started = False  # the preamble went out
        self._read_since_sync = False
        self._ended = False  # no more chunks will be queued
        self._closed = False  # the reader closed it

    def get(self, timeout: float) -> bytes | None:
        """The next bytes of the stream (whole records); None if none came within
        `timeout` seconds; b"" once the stream has ended."""
        with self._cond:
            if not self._chunks and not self._ended:
                self._cond.wait_for(lambda: bool(self._chunks) or self._ended, timeout)
            if not self._chunks:
                return b"" if self._ended else None
            out = [self._chunks.popleft()]
            size = len(out[0])
            while self._chunks and size + len(self._chunks[0]) <= CHUNK_BYTES:
                out.append(self._chunks.popleft())
                size += len(out[-1])
            self.buffered -= size
            self._read_since_sync = True
            return out[0] if len(out) == 1 else b"".join(out)

    def close(self) -> None:
        """Stop receiving; what is queued is dropped. Idempotent."""
        with self._cond:
            self._closed = self._ended = True
            self._chunks.clear()
            self.buffered = 0
            self._cond.notify_all()
        self._hub.discard(self)

    @property
    def ended(self) -> bool:
        return self._ended

    # -- the engine thread's side ----------------------------------------------------------

    def _push(self, data: bytes) -> bool:
        """Queue one record; False when it no longer streams (behind or ended)."""
        with self._cond:
            if self._ended or self._state != _LIVE:
                return False
            if self.buffered + len(data) <= self._limit:
                self._chunks.append(data)
                self.buffered += len(data)
                self._cond.notify_all()
                return True
            # Behind: what is queued is stale now. Skip to a fresh snapshot, unless it
            # has not read a byte since the last one (it is stuck, not slow).
            self._chunks.clear()
            self.buffered = 0
            if self._read_since_sync:
                self.skips += 1
                self._state = _RESYNC
            else:
                self.dropped = self._ended = True
            self._cond.notify_all()
            return False

    def _sync(self, preamble: bytes, records: bytes) -> None:
        """Queue a fresh header and snapshot (and the preamble the first time)."""
        with self._cond:
            if self._ended:
                return
            data = records if self._started else preamble + records
            if self.buffered + len(data) > self._limit:
                self.dropped = self._ended = True  # cannot even hold the state
            else:
                self._chunks.append(data)
                self.buffered += len(data)
                self._started = True
                self._state = _LIVE
                self._read_since_sync = False
            self._cond.notify_all()

    def _end(self) -> None:
        """The stream is over: get() returns what is queued, then b""."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()


class StreamHub:
    """The subscriptions of one recording."""

    def __init__(self, limit: int = DEFAULT_LIMIT, max_viewers: int = DEFAULT_MAX_VIEWERS) -> None:
        if limit < 1 or max_viewers < 1:
            raise ValueError(f"limit={limit}, max_viewers={max_viewers}: must be >= 1")
        self.limit = limit
        self.max_viewers = max_viewers
        self._lock = threading.Lock()
        self._subs: list[StreamSubscription] = []
        # Read without the lock by the engine thread: a stale value costs one check late.
        self.live: tuple[StreamSubscription, ...] = ()  # those that get every record
        self.pending = False  # some want a header and snapshot
        self._closed = False

    def subscribe(self) -> StreamSubscription:
        with self._lock:
            if self._closed:
                sub = StreamSubscription(self, self.limit)
                sub._end()
                return sub
            self._subs = [s for s in self._subs if not s.ended]
            if len(self._subs) >= self.max_viewers:
                raise TooManyViewers(
                    f"{len(self._subs)} viewers are attached, the most this server serves"
                )
            sub = StreamSubscription(self, self.limit)
            self._subs.append(sub)
            self.pending = True
            return sub

    def discard(self, sub: StreamSubscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            self._rebuild()

    def publish(self, data: bytes) -> None:
        """Queue one record for every streaming viewer (engine thread)."""
        behind = False
        for sub in self.live:
            if not sub._push(data):
                behind = True
        if behind:
            with self._lock:
                self._rebuild()

    def serve_pending(self, preamble: bytes, make_records: Callable[[], bytes]) -> None:
        """Give every viewer that waits for one a header and snapshot (engine thread,
        between two steps); `make_records` is called once, only if one waits."""
        with self._lock:
            waiting = [s for s in self._subs if s._state != _LIVE and not s.ended]
            if waiting:
                records = make_records()
                for sub in waiting:
                    sub._sync(preamble, records)
            self._rebuild()

    def close(self) -> None:
        """End every stream (the recording is over)."""
        with self._lock:
            self._closed = True
            subs, self._subs = self._subs, []
            self._rebuild()
        for sub in subs:
            sub._end()

    def _rebuild(self) -> None:
        self._subs = [s for s in self._subs if not s.ended]
        self.live = tuple(s for s in self._subs if s._state == _LIVE)
        self.pending = len(self.live) < len(self._subs)
