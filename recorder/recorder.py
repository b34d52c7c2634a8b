"""The Recorder: an engine's event sink that writes every step into a trace.

    recorder = open_recording(engine, path)   # or Recorder(engine, TraceWriter(path))
    ... engine.step() ...                      # every step is recorded
    engine.close()                             # closes the recorder: footer, fsync

The engine does not know the recorder exists: the recorder installs itself as
`engine.sink` and passes every report on to the sink it replaced.
"""

from __future__ import annotations

import logging
import socket
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from engine.core import EngineCore
from engine.records import Step
from recorder.codec import MAX_RECORD_BYTES, encode
from recorder.convert import StepCompactor, scalar_config
from recorder.errors import RecordingError
from recorder.paths import new_trace_path
from recorder.schema import End, Footer, Header, Record, Snapshot
from recorder.writer import TraceSink, TraceWriter

log = logging.getLogger("schedtop.recorder")

DEFAULT_SNAPSHOT_INTERVAL = 256


class Recorder:
    """Records every step of `engine` into `sink`, starting now.

    Attach it to a fresh engine, or between two steps of a running one (it then starts
    with a snapshot). A recording that fails (disk full, or a bug here) stops with one
    warning and never stops the engine, unless `strict` (tests) makes it raise."""

    def __init__(
        self,
        engine: EngineCore,
        sink: TraceSink,
        *,
        redact_prompts: bool = False,
        snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
        model: str | None = None,
        strict: bool = False,
        on_step_record: Callable[[Step], None] | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if snapshot_interval < 1:
            raise ValueError(f"snapshot_interval={snapshot_interval}: must be >= 1")
        mid_run = engine.step_index > 0
        if mid_run and engine.scheduler.has_unreported:
            raise ValueError(
                "attach the recorder to a fresh engine or right after a step, "
                "not after adding or aborting requests"
            )
        self.engine = engine
        self.sink = sink
        self.snapshot_interval = snapshot_interval
        self.strict = strict
        self.on_step_record = on_step_record  # sees every Step record before it is written
        self.error: str | None = None  # why recording stopped, once it has
        self._clock = clock
        self._t0 = clock()
        self._closed = False
        self._first_step = engine.step_index
        self._compactor = StepCompactor(engine.config.policy, redact_prompts)
        self._step_offsets = array("Q")
        self._step_ends = array("Q")
        self._snapshots: list[tuple[int, int]] = []
        self._counts = [0, 0, 0, 0]  # steps, arrivals, finishes, preemptions
        self._append(self._header(engine, model, redact_prompts, wall_clock()), boundary=True)
        if mid_run:
            snap = engine.snapshot()
            self._compactor.adopt(snap)
            self._write_snapshot(snap)
        self._downstream = engine.sink
        engine.sink = self

    @property
    def path(self) -> Path | None:
        """The trace file, when the sink is one."""
        return getattr(self.sink, "path", None)

    @property
    def flushed_step(self) -> int:
        """The last step whose record a reader can already see (first_step - 1: none)."""
        return self._first_step + bisect_right(self._step_ends, self.sink.flushed) - 1

    # -- EventSink -------------------------------------------------------------------------

    def on_step(self, report: Step) -> None:
        if self.error is None:
            try:
                self._record(report)
            except Exception as e:
                if self.strict:
                    raise
                log.exception("recording failed at step %d", report.step)
                self.error = f"step {report.step}: {type(e).__name__}: {e}"
        self._downstream.on_step(report)

    def close(self) -> None:
        """Write the footer (if recording went well), flush, fsync and close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.engine.sink is self:
            self.engine.sink = self._downstream
        try:
            if self.error is None and self.sink.error is None:
                offset = self._append(self._footer())
                self._append(End(offset))
        finally:
            self.sink.close()
            if self.error is None:
                self.error = self.sink.error
            self._downstream.close()

    # -- records -----------------------------------------------------------------------------

    def _record(self, report: Step) -> None:
        if self.sink.error is not None:
            self.error = self.sink.error
            return
        time_ns = self._clock() - self._t0
        snapshot_due = (report.step + 1) % self.snapshot_interval == 0
        step = self._compactor.compact(report, time_ns)
        if self.on_step_record is not None:
            self.on_step_record(step)
        offset = self._append(step, boundary=not snapshot_due)
        self._step_offsets.append(offset)
        self._step_ends.append(self.sink.offset)
        counts = self._counts
        counts[0] += 1
        counts[1] += len(report.arrivals)
        counts[2] += len(report.finishes)
        counts[3] += len(report.preemptions)
        if snapshot_due:
            self._write_snapshot(self.engine.snapshot())

    def _write_snapshot(self, snap: Snapshot) -> None:
        self._snapshots.append((snap.step, self._append(snap, boundary=True)))

    def _append(self, record: Record, boundary: bool = False) -> int:
        rtype, body = encode(record)
        return self.sink.append(rtype, body, boundary=boundary)

    def _header(
        self, engine: EngineCore, model: str | None, redacted: bool, start_ns: int
    ) -> Header:
        cfg = engine.config
        if model is None:
            described = getattr(engine.runner, "model_description", "")
            model = described if isinstance(described, str) else ""
        return Header(
            engine=f"schedtop {_version()} ({type(engine.runner).__name__})",
            model=model,
            config=scalar_config(cfg.to_dict()),
            block_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
            policy=cfg.policy,
            start_time_ns=start_ns,
            host=socket.gethostname(),
            redacted=redacted,
            first_step=engine.step_index,
            snapshot_interval=self.snapshot_interval,
        )

    def _footer(self) -> Footer:
        offsets = tuple(self._step_offsets)
        if len(offsets) * 8 > MAX_RECORD_BYTES // 2:
            offsets = ()  # too many to index: readers scan instead
        steps, arrivals, finishes, preemptions = self._counts
        return Footer(
            first_step=self._first_step,
            step_offsets=offsets,
            snapshot_steps=tuple(s for s, _ in self._snapshots),
            snapshot_offsets=tuple(o for _, o in self._snapshots),
            num_steps=steps,
            num_arrivals=arrivals,
            num_finishes=finishes,
            num_preemptions=preemptions,
            end_time_ns=self._clock() - self._t0,
        )


def open_recording(
    engine: EngineCore,
    path: str | Path | None = None,
    *,
    kind: str = "run",
    redact_prompts: bool = False,
    live: bool = True,
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
    model: str | None = None,
) -> Recorder:
    """Record `engine` into `path`, or into a new file in the default trace directory
    (see recorder.paths) named after `kind` ("run", "sim", "demo"). `live` flushes every
    step, so that `schedtop live` sees each one at once. Raises RecordingError when the
    file cannot be created."""
    if path is None:
        path = new_trace_path(kind)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecordingError(
                f"{path.parent}: cannot create the trace directory: {e.strerror}"
            ) from None
    writer = TraceWriter(path, live=live)
    try:
        return Recorder(
            engine,
            writer,
            redact_prompts=redact_prompts,
            snapshot_interval=snapshot_interval,
            model=model,
        )
    except BaseException:
        writer.close()
        raise


def _version() -> str:
    try:
        return metadata.version("schedtop")
    except metadata.PackageNotFoundError:
        return "dev"
