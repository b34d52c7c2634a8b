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
import math
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core import EngineCore
from engine.events import report_client
from engine.records import Client, Step
from recorder.codec import encode
from recorder.errors import RecordingError
from recorder.framing import frame, preamble
from recorder.paths import make_trace_dir, new_run_dir
from recorder.reader import TraceReader
from recorder.recorder import (
    DEFAULT_SNAPSHOT_INTERVAL,
    FLUSH_INTERVAL_S,
    RecordedEngine,
    Recorder,
    RecorderOptions,
)
from recorder.schema import RecordType
from recorder.segments import INCIDENTS, is_run_dir, join, list_segments, segment_name
from recorder.stream import DEFAULT_LIMIT, DEFAULT_MAX_VIEWERS, StreamHub, StreamSubscription
from recorder.writer import TraceWriter

log = logging.getLogger("schedtop.recorder")

DEFAULT_MAX_BYTES = 2 << 30
MIN_MAX_BYTES = 64 << 10
SEGMENTS_PER_BOUND = 8  # a segment is closed at max_bytes / 8
SEGMENT_S = 60.0  # ...or after this long
INCIDENT_SHARE = 4  # incidents may use 1/4 of max_bytes unless given their own bound
INCIDENT_INTERVAL_S = 10.0  # at most one incident this often (a rate limit: each copies MBs)
MAX_NOTE_CHARS = 4096  # an incident's note: a line for a human, not a payload
META_RESERVE = 1024  # an incident's JSON file, less its note
ROTATE_RETRY_S = 1.0  # a failed segment creation is tried again after this long
DEFAULT_KEEP_RUNS = 16  # run directories kept in a trace directory (a crash loop makes many)
FLUSH_S = 0.1  # written records reach the file at least this often while steps run
FLUSH_WAIT_S = 2.0  # incident(): how long to wait for the engine thread to flush

__all__ = [
    "IncidentError",
    "IncidentResult",
    "ServerRecording",
    "StreamSubscription",
    "open_server_recording",
]


class IncidentError(RecordingError):
    """An incident that was not cut; `status` is the HTTP status a server answers with
    (429 too soon after the last one, 507 no room for it) and `retry_after_s` when to try
    again, if waiting helps."""

    def __init__(self, message: str, status: int, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class IncidentResult:
    """An incident trace that was written."""

    path: Path  # the trace file
    relative: str  # its path relative to the run's parent (the trace directory)
    first_step: int  # its first step
    last_step: int  # its last step
    size: int  # bytes


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
        core: RecordedEngine,
        directory: Path,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        redact_prompts: bool = False,
        model: str | None = None,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
        segment_s: float = SEGMENT_S,
        incident_max_bytes: int | None = None,
        incident_interval_s: float = INCIDENT_INTERVAL_S,
        stream_limit: int = DEFAULT_LIMIT,
        max_viewers: int = DEFAULT_MAX_VIEWERS,
        clock: Callable[[], int] = time.monotonic_ns,
        new_recorder: Callable[[TraceWriter, Recorder | None], Recorder] | None = None,
    ) -> None:
        """`new_recorder(writer, previous)` makes each segment's Recorder (an engine whose
        recorder takes options of its own: vLLM's, recorder.vllm.live); by default one
        with this class's options, continuing `previous`."""
        if max_bytes < MIN_MAX_BYTES:
            raise ValueError(f"max_bytes={max_bytes}: must be at least {MIN_MAX_BYTES} bytes")
        if segment_s <= 0:
            raise ValueError(f"segment_s={segment_s}: must be > 0")
        if incident_max_bytes is None:
            incident_max_bytes = max_bytes // INCIDENT_SHARE
        if not 0 <= incident_max_bytes <= max_bytes // 2:
            raise ValueError(
                f"incident_max_bytes={incident_max_bytes}: must be in 0..{max_bytes // 2} "
                "(half the trace bound at most: incidents count against it; 0 = no incidents)"
            )
        if not incident_interval_s >= 0:
            raise ValueError(f"incident_interval_s={incident_interval_s}: must be >= 0")
        make_trace_dir(directory)
        if list_segments(directory):
            raise RecordingError(f"{directory}: holds another run's segments already")
        self.core = core
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = max_bytes // SEGMENTS_PER_BOUND
        self.segment_s = segment_s
        # Incidents count against max_bytes: the segments keep out of their share.
        self.incident_max_bytes = incident_max_bytes
        self.incident_interval_s = incident_interval_s
        self.error: str | None = None  # why recording stopped, if it has
        self.rotate_error: str | None = None  # the last failed rotation (retried), if any
        self.rotations_failed = 0
        self._rotate_retry_at = 0  # clock: no rotation is tried before this
        self._last_incident: int | None = None  # clock of the last incident cut
        self._incident_lock = threading.Lock()  # one incident at a time
        self._clock = clock
        self._options = RecorderOptions(
            redact_prompts=redact_prompts,
            model=model,
            snapshot_interval=snapshot_interval,
            clock=clock,
            # The engine thread flushes every FLUSH_S while it steps, and when idle; the
            # timer writes out the last steps of an engine thread that hangs.
            flush_interval_s=FLUSH_INTERVAL_S,
        )
        self._new_recorder = new_recorder
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

    def on_step(self, report: Step) -> None:
        self._recorder.on_step(report)
        self._downstream.on_step(report)
        self._between_steps()
        if self._rotation_due():
            self._rotate()

    def on_client(self, report: Client) -> None:
        """A server's view of one HTTP request (engine thread, between two steps)."""
        self._recorder.on_client(report)
        report_client(self._downstream, report)
        # Client records alone can fill a segment (a flood of refused requests and no
        # step at all): the bound is checked on every append, not only after steps.
        if self._rotation_due():
            self._rotate()

    def on_idle(self) -> None:
        """Called by the engine thread when it has no work (at least every 100 ms):
        writes out what is buffered and serves viewers waiting for a snapshot."""
        writer = self._writer
        if writer is not None:
            writer.flush()
        self._between_steps()

    def close(self, stopped: str = "") -> None:
        """Close the last segment (footer) and end every viewer's stream. Idempotent.
        `stopped`: why recording stops while the engine goes on (Recorder.close)."""
        if self._closed:
            return
        self._closed = True
        if self.core.sink is self:
            self.core.sink = self._downstream
        try:
            self._recorder.close(stopped)
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
    def stopped(self) -> str | None:
        """Why the recording stopped (None while it records)."""
        if self._closed:
            return self.error or self._recorder.error or "closed"
        return self.error or self._recorder.error

    @property
    def _writer(self) -> TraceWriter | None:
        sink = self._recorder.sink
        return sink if isinstance(sink, TraceWriter) else None

    def _between_steps(self) -> None:
        if self._hub.pending and not self.core.has_unreported:
            # A recorder in the background may not have published the last steps yet:
            # they go out before the snapshot that follows them.
            self._recorder.drain()
            self._hub.serve_pending(preamble(), self._stream_start)
        if self._flush_asked != self._flush_done:
            self._recorder.drain()
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
        if self.error is not None or self._recorder.error is not None or self._closed:
            return False
        if self.rotate_error is not None and self._clock() < self._rotate_retry_at:
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
        old.drain()
        if (writer := self._writer) is not None:
            writer.drain()
        try:
            new = self._new_segment(old)
        except RecordingError as e:
            # Tried again later (a full disk may get room): one failure must not end the
            # bound for the rest of the run. Meanwhile the oldest segments make room.
            if self.rotate_error is None:
                log.warning("cannot start a new segment (%s); retrying", e)
            self.rotate_error = str(e)
            self.rotations_failed += 1
            self._rotate_retry_at = self._clock() + int(ROTATE_RETRY_S * 1e9)
            with self._lock:
                self._delete_oldest(self._current_size())
            return
        self.rotate_error = None
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

    def _current_size(self) -> int:
        writer = self._writer
        return writer.offset if writer is not None else 0

    def _delete_oldest(self, current: int = 0) -> None:
        """Keep the closed segments within max_bytes less the incidents' share and room
        for the one being written: its opening header and snapshot, segment_bytes of
        steps, and as much again (it may overshoot by a step, and the next opening
        snapshot may be larger); or less its actual size, when it has grown past that
        (rotation failing)."""
        written = max(current, 2 * (self.segment_bytes + self._start_bytes))
        room = self.max_bytes - self.incident_max_bytes - written
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
            if self._new_recorder is not None:
                recorder = self._new_recorder(writer, previous)
            else:
                recorder = Recorder(
                    self.core, writer, self._options, install=False, continue_from=previous
                )
        except BaseException:
            writer.close()
            raise
        recorder.drain()  # its header and opening snapshot, before they are measured
        writer.quiet = False
        writer.drain()
        self._start_bytes = writer.offset  # preamble, header and opening snapshot
        return recorder

    # -- other threads --------------------------------------------------------------------------

    def subscribe(self) -> StreamSubscription:
        """A new viewer's stream: it starts with a header and snapshot at the next point
        between two steps (or idle call). Raises TooManyViewers past the limit."""
        return self._hub.subscribe()

    def incident(self, window_s: float, note: str | None = None) -> IncidentResult:
        """Copy the segments covering the last `window_s` seconds into one trace file
        (under `incidents/` in the run's directory). A note goes into a JSON file of the
        same name next to it. The window is cut to the newest segments that fit within
        incident_max_bytes (the result's first_step says where it begins), older
        incidents are deleted to make room, and one is cut at most once per
        incident_interval_s: IncidentError otherwise. ValueError for a window
        that is not a finite number > 0 or a note over MAX_NOTE_CHARS."""
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s={window_s}: must be a finite number > 0")
        if note is not None and len(note) > MAX_NOTE_CHARS:
            raise ValueError(f"note: {len(note)} characters; at most {MAX_NOTE_CHARS}")
        if self.incident_max_bytes == 0:
            raise IncidentError("incidents are off (an incident bound of 0 bytes)", 507)
        if not self._incident_lock.acquire(blocking=False):
            raise IncidentError(
                "another incident is being cut", 429, retry_after_s=self.incident_interval_s
            )
        try:
            return self._cut_incident(window_s, note)
        finally:
            self._incident_lock.release()

    def _cut_incident(self, window_s: float, note: str | None) -> IncidentResult:
        now = self._clock()
        if self._last_incident is not None:
            wait = self._last_incident + self.incident_interval_s * 1e9 - now
            if wait > 0:
                raise IncidentError(
                    f"one incident per {self.incident_interval_s:g} s; try again in "
                    f"{wait / 1e9:.1f} s",
                    429,
                    retry_after_s=wait / 1e9,
                )
        self._wait_for_flush()
        rec = self._recorder
        since = rec.elapsed_ns - int(window_s * 1e9)
        # Room for the note's JSON file beside the trace (its other fields are small).
        budget = self.incident_max_bytes - len(json.dumps(note)) - META_RESERVE
        with self._lock:
            wanted = [s.path for s in self._closed_segments if s.end_ns >= since]
            wanted.append(self.segment)
            # The newest segments that fit the incidents' bound: a window longer than
            # that is cut (the reply's first step says where), not refused.
            paths: list[Path] = []
            estimate = 0
            for p in reversed(wanted):
                size = _file_size(p)
                if paths and estimate + size > budget:
                    break
                paths.insert(0, p)
                estimate += size
            readers = _open_all(paths)  # open now: rotation may delete them from here on
        try:
            if estimate > budget:
                raise IncidentError(
                    f"the segment being written is {estimate} bytes, more than the "
                    f"incidents' bound of {self.incident_max_bytes} bytes: raise "
                    "--incident-max-bytes",
                    507,
                )
            out = self._incident_path()
            self._last_incident = now
            self._make_room(self.incident_max_bytes - budget + estimate)
            joined = join(readers, out, since_ns=since)
        finally:
            for r in readers:
                r.close()
        if joined.size > budget:  # the estimate missed (a segment grew meanwhile)
            out.unlink(missing_ok=True)
            raise IncidentError(
                f"the incident came to {joined.size} bytes, more than the incidents' bound "
                f"of {self.incident_max_bytes} bytes: ask for a shorter window",
                507,
            )
        meta = {
            "trace": out.name,
            "note": note,
            "window_s": window_s,
            "first_step": joined.first_step,
            "last_step": joined.last_step,
            "segments": [p.name for p in paths],
            "cut_to_bound": len(paths) < len(wanted),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        try:
            out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
        except OSError as e:
            raise RecordingError(f"{out}: cannot write its note: {e.strerror}") from None
        self._make_room(0, keep=out)  # hold the bound exactly, whatever the estimate
        return IncidentResult(
            out,
            out.relative_to(self.directory.parent).as_posix(),
            joined.first_step,
            joined.last_step,
            joined.size,
        )

    def _make_room(self, wanted: int, keep: Path | None = None) -> None:
        """Delete the oldest incidents (never `keep`) until those left plus `wanted`
        bytes fit within incident_max_bytes."""
        folder = self.directory / INCIDENTS
        try:
            files = sorted(p for p in folder.iterdir() if p.suffix in (".trace", ".json"))
        except OSError:
            return
        sizes = {p: _file_size(p) for p in files}
        total = sum(sizes.values())
        # Names sort by time; a trace and its note share a stem and go together (the
        # stem has a dot of its own: "incident-20261201-120000.123").
        stems = sorted({p.name.rsplit(".", 1)[0] for p in sizes})
        if keep is not None:
            stems = [s for s in stems if s != keep.name.rsplit(".", 1)[0]]
        for stem in stems:
            if total + wanted <= self.incident_max_bytes:
                break
            for p in (folder / f"{stem}.trace", folder / f"{stem}.json"):
                if p in sizes:
                    try:
                        p.unlink()
                        total -= sizes[p]
                    except OSError as e:
                        log.warning("cannot delete the old incident %s: %s", p, e.strerror)

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


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def prune_runs(parent: Path, kind: str, keep: int) -> list[Path]:
    """Delete the oldest run directories of `kind` in `parent` so that at most `keep`
    remain (a crash loop starts a new one each time, and the per-run bound does not
    bound them together); returns those deleted. Only directories named as
    recorder.paths.new_run_dir names them and holding segments are touched."""
    if keep < 1:
        raise ValueError(f"keep={keep}: must be >= 1")
    try:
        runs = sorted(p for p in parent.iterdir() if f"-{kind}-" in p.name and is_run_dir(p))
    except OSError:
        return []
    gone = []
    for run in runs[: max(0, len(runs) - keep)]:
        try:
            shutil.rmtree(run)
            gone.append(run)
        except OSError as e:
            log.warning("cannot delete the old run directory %s: %s", run, e.strerror)
    return gone


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
    incident_max_bytes: int | None = None,
    keep_runs: int = DEFAULT_KEEP_RUNS,
) -> ServerRecording:
    """Record a server's engine (an LLMEngine or an EngineCore) into a new run directory
    under `trace_dir` (None: the default trace directory), deleting the oldest server
    runs there beyond `keep_runs` (this one included). Raises ValueError for a bad
    bound, RecordingError when the directory cannot be made."""
    core = getattr(engine, "core", engine)
    if not isinstance(core, EngineCore):
        raise TypeError(f"cannot record a {type(engine).__name__}: not an engine")
    if keep_runs < 1:
        raise ValueError(f"keep_runs={keep_runs}: must be >= 1")
    run = new_run_dir("serve", trace_dir)
    recording = ServerRecording(
        core,
        run,
        max_bytes=max_bytes,
        redact_prompts=redact_prompts,
        model=model,
        incident_max_bytes=incident_max_bytes,
    )
    prune_runs(run.parent, "serve", keep_runs)
    return recording
