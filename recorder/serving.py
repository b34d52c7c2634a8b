"""The flight recorder of a long-running server: rotating segments, a live stream, and
incident extraction.

    rec = open_server_recording(engine, trace_dir)   # installs itself as the engine's sink
    ... engine thread: engine.step() ...; rec.on_idle() when there is no work
    ... any thread: rec.subscribe().get(timeout); rec.incident(600.0, "p99 spike")
    rec.close()

The trace is written as segments in one directory per run (recorder.segments): each
segment is a whole trace (header, snapshot, steps, footer), and they continue each other
(same refs, same clock), so the directory reads as one trace. A segment is closed and a
new one started when its steps reach 1/8 of `max_bytes` or it is `segment_s` seconds old,
and the oldest are deleted so that the directory stays under `max_bytes` (unless one
opening snapshot alone is larger than that). One Recorder per segment does
the recording; this class only decides when to rotate and feeds the viewers' streams
(recorder.stream) with the very records it writes.

Threads: the engine thread calls on_step (through the engine) and on_idle; the server's
threads call subscribe, incident and the subscriptions' get/close. Snapshots are taken
only in the engine thread, between two steps.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core import EngineCore
from engine.events import ClientReport, report_client
from engine.report import StepReport
from recorder.codec import encode
from recorder.errors import RecordingError
from recorder.framing import frame, preamble
from recorder.paths import new_run_dir
from recorder.reader import TraceReader
from recorder.recorder import DEFAULT_SNAPSHOT_INTERVAL, FLUSH_INTERVAL_S, Recorder
from recorder.schema import RecordType
from recorder.segments import INCIDENTS, join, list_segments, segment_name
from recorder.stream import DEFAULT_LIMIT, DEFAULT_MAX_VIEWERS, StreamHub, StreamSubscription
from recorder.writer import TraceWriter

log = logging.getLogger("schedtop.recorder")

DEFAULT_MAX_BYTES = 2 << 30
MIN_MAX_BYTES = 64 << 10
SEGMENTS_PER_BOUND = 8  # a segment is closed at max_bytes / 8
SEGMENT_S = 60.0  # ...or after this long: an incident copies whole segments
FLUSH_S = 0.1  # written records reach the file at least this often while steps run
FLUSH_WAIT_S = 2.0  # incident(): how long to wait for the engine thread to flush

__all__ = ["ServerRecording", "StreamSubscription", "open_server_recording"]


# What a viewer's stream carries after its header and snapshot: not the segments' own
# headers, first snapshots, footers and ends (the stream goes on across rotations).
_STREAMED = frozenset((RecordType.STEP, RecordType.SNAPSHOT, RecordType.CLIENT))


@dataclass(frozen=True, slots=True)
class _Closed:
    """A segment that is complete on disk."""

    path: Path  # the file
    size: int  # bytes
    end_ns: int  # the recording's clock when it was closed (ns since the start)


class _SegmentWriter(TraceWriter):
    """A segment's file writer that also hands each STEP and SNAPSHOT record it writes
    to the viewers, framed as in the file."""

    def __init__(self, path: Path, hub: StreamHub) -> None:
        super().__init__(path, live=False, flush_interval_s=FLUSH_S)
        self.hub = hub
        self.quiet = True  # the segment's own header and first snapshot are not streamed

    def append(self, rtype: int, body: bytes, *, boundary: bool = False) -> int:
        offset = super().append(rtype, body, boundary=boundary)
        if self.hub.live and not self.quiet and rtype in _STREAMED:
            self.hub.publish(frame(rtype, body))
        return offset


class ServerRecording:
    """Records an engine into rotating segments and streams it to viewers."""

    def __init__(
        self,
        core: EngineCore,
        directory: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        redact_prompts: bool = False,
        model: str | None = None,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
        segment_s: float = SEGMENT_S,
        stream_limit: int = DEFAULT_LIMIT,
        max_viewers: int = DEFAULT_MAX_VIEWERS,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"max_bytes={max_bytes}: must be at least {MIN_MAX_BYTES} bytes")
        if segment_s <= 0:
            raise ValueError(f"segment_s={segment_s}: must be > 0")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecordingError(
                f"{directory}: cannot create the trace directory: {e.strerror}"
            ) from None
        if list_segments(directory):
            raise RecordingError(f"{directory}: holds another run's segments already")
        self.core = core
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = max_bytes // SEGMENTS_PER_BOUND
        self.segment_s = segment_s
        self.error: str | None = None  # why rotation or recording stopped, if it has
        self._clock = clock
        self._options: dict[str, Any] = dict(
            redact_prompts=redact_prompts,
            model=model,
            snapshot_interval=snapshot_interval,
            clock=clock,
            # The engine thread flushes every FLUSH_S while it steps, and when idle; the
            # timer writes out the last steps of an engine thread that hangs.
            flush_interval_s=FLUSH_INTERVAL_S,
        )
        self._hub = StreamHub(stream_limit, max_viewers)
        self._lock = threading.Lock()  # the segment list, read by incident()
        self._closed_segments: list[_Closed] = []
        self._seq = 0
        self._start_bytes = 0  # the current segment's bytes before its first step
        self._flush_asked = 0  # incident() asks the engine thread to flush...
        self._flush_done = 0  # ...and waits until it has
        self._flush_cond = threading.Condition(self._lock)
        self._closed = False
        self._recorder = self._new_segment(None)
        self._segment_started = clock()
        self._downstream = core.sink
        core.sink = self

    # -- the engine thread --------------------------------------------------------------------

    def on_step(self, report: StepReport) -> None:
        self._recorder.on_step(report)
        self._downstream.on_step(report)
        self._between_steps()
        if self._rotation_due():
            self._rotate()

    def on_client(self, report: ClientReport) -> None:
        """A server's view of one HTTP request (engine thread, between two steps)."""
        self._recorder.on_client(report)
        report_client(self._downstream, report)

    def on_idle(self) -> None:
        """Called by the engine thread when it has no work (at least every 100 ms):
        writes out what is buffered and serves viewers waiting for a snapshot."""
        writer = self._writer
        if writer is not None:
            writer.flush()
        self._between_steps()

    def close(self) -> None:
        """Close the last segment (footer) and end every viewer's stream. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.core.sink is self:
            self.core.sink = self._downstream
        try:
            self._recorder.close()
            self.error = self.error or self._recorder.error
        finally:
            self._hub.close()
            with self._flush_cond:
                self._flush_done = self._flush_asked
                self._flush_cond.notify_all()
            self._downstream.close()

    @property
    def segment(self) -> Path:
        """The segment being written."""
        path = self._recorder.path
        assert path is not None
        return path

    @property
    def flushed_step(self) -> int:
        """The last step a reader of the directory can already see."""
        return self._recorder.flushed_step

    @property
    def _writer(self) -> TraceWriter | None:
        sink = self._recorder.sink
        return sink if isinstance(sink, TraceWriter) else None

    def _between_steps(self) -> None:
        if self._hub.pending and not self.core.scheduler.has_unreported:
            self._hub.serve_pending(preamble(), self._stream_start)
        if self._flush_asked != self._flush_done:
            writer = self._writer
            if writer is not None:
                writer.drain()
            with self._flush_cond:
                self._flush_done = self._flush_asked
                self._flush_cond.notify_all()

    def _stream_start(self) -> bytes:
        """A viewer's first records: a header whose first step is the next one, and the
        state now."""
        rec = self._recorder
        header = dataclasses.replace(rec.header, first_step=self.core.step_index)
        out = frame(*encode(header))
        if self.core.step_index > 0:
            out += frame(*encode(self.core.snapshot()))
        return out

    def _rotation_due(self) -> bool:
        if self.error is not None or self._recorder.error is not None:
            return False
        writer = self._writer
        size = writer.offset - self._start_bytes if writer is not None else 0
        return size >= self.segment_bytes or (
            self._clock() - self._segment_started >= self.segment_s * 1e9
        )

    def _rotate(self) -> None:
        old = self._recorder
        # Every step of this segment is written before the next segment starts: else a
        # kill between the two leaves this one cut short of steps that the next one's
        # first step says came before it, a gap that reads as a missing segment.
        if (writer := self._writer) is not None:
            writer.drain()
        try:
            new = self._new_segment(old)
        except RecordingError as e:
            self.error = str(e)
            log.warning("cannot start a new segment (%s); recording goes on in %s", e, old.path)
            return
        # The next segment is on disk before this one ends: a reader that finds this
        # one finished and no next one knows the recording is over.
        old.close()
        self._segment_started = self._clock()
        path = old.path
        assert path is not None
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        with self._lock:  # incident() sees the old one either current or closed
            self._recorder = new
            self._closed_segments.append(_Closed(path, size, old.elapsed_ns))
            self._delete_oldest()

    def _delete_oldest(self) -> None:
        """Keep the closed segments within max_bytes less room for the one being written:
        its opening header and snapshot, segment_bytes of steps, and as much again (it
        may overshoot by a step, and the next opening snapshot may be larger)."""
        room = self.max_bytes - 2 * (self.segment_bytes + self._start_bytes)
        total = sum(s.size for s in self._closed_segments)
        while self._closed_segments and total > room:
            gone = self._closed_segments.pop(0)
            total -= gone.size
            try:
                gone.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot delete the old segment %s: %s", gone.path, e.strerror)

    def _new_segment(self, previous: Recorder | None) -> Recorder:
        path = self.directory / segment_name(self._seq)
        self._seq += 1
        writer = _SegmentWriter(path, self._hub)
        try:
            recorder = Recorder(
                self.core, writer, install=False, continue_from=previous, **self._options
            )
        except BaseException:
            writer.close()
            raise
        writer.quiet = False
        writer.drain()
        self._start_bytes = writer.offset  # preamble, header and opening snapshot
        return recorder

    # -- other threads --------------------------------------------------------------------------

    def subscribe(self) -> StreamSubscription:
        """A new viewer's stream: it starts with a header and snapshot at the next point
        between two steps (or idle call). Raises TooManyViewers past the limit."""
        return self._hub.subscribe()

    def incident(self, window_s: float, note: str | None = None) -> Path:
        """Copy the segments covering the last `window_s` seconds into one trace file
        (under `incidents/` in the run's directory) and return its path. A note goes into
        a JSON file of the same name next to it."""
        if not window_s > 0:
            raise ValueError(f"window_s={window_s}: must be > 0")
        self._wait_for_flush()
        rec = self._recorder
        since = rec.elapsed_ns - int(window_s * 1e9)
        with self._lock:
            paths = [s.path for s in self._closed_segments if s.end_ns >= since]
            paths.append(self.segment)
            readers = _open_all(paths)  # open now: rotation may delete them from here on
        try:
            out = self._incident_path()
            joined = join(readers, out)
        finally:
            for r in readers:
                r.close()
        meta = {
            "trace": out.name,
            "note": note,
            "window_s": window_s,
            "first_step": joined.first_step,
            "last_step": joined.last_step,
            "segments": [p.name for p in paths],
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
        return out

    def _wait_for_flush(self) -> None:
        with self._flush_cond:
            if self._closed:
                return
            self._flush_asked += 1
            asked = self._flush_asked
            self._flush_cond.wait_for(lambda: self._flush_done >= asked, FLUSH_WAIT_S)

    def _incident_path(self) -> Path:
        folder = self.directory / INCIDENTS
        try:
            folder.mkdir(exist_ok=True)
        except OSError as e:
            raise RecordingError(f"{folder}: cannot create it: {e.strerror}") from None
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S.%f")[:-3]
        path = folder / f"incident-{stamp}.trace"
        n = 1
        while path.exists():
            n += 1
            path = folder / f"incident-{stamp}-{n}.trace"
        return path


def _open_all(paths: list[Path]) -> list[TraceReader]:
    readers: list[TraceReader] = []
    try:
        for p in paths:
            readers.append(TraceReader(p))
    except BaseException:
        for r in readers:
            r.close()
        raise
    return readers


def open_server_recording(
    engine: Any,
    trace_dir: Path | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    redact_prompts: bool = False,
    model: str | None = None,
) -> ServerRecording:
    """Record a server's engine (an LLMEngine or an EngineCore) into a new run directory
    under `trace_dir` (None: the default trace directory). Raises ValueError for a bad
    bound, RecordingError when the directory cannot be made."""
    core = getattr(engine, "core", engine)
    if not isinstance(core, EngineCore):
        raise TypeError(f"cannot record a {type(engine).__name__}: not an engine")
    return ServerRecording(
        core,
        new_run_dir("serve", trace_dir),
        max_bytes=max_bytes,
        redact_prompts=redact_prompts,
        model=model,
    )
