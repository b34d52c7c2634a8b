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
import threading
import time
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.events import NULL_SINK, EventSink, report_client
from engine.records import KVEvents, Step
from recorder.background import Background
from recorder.codec import MAX_RECORD_BYTES, STEADY_FIELDS, encode, encode_steady
from recorder.convert import StepCompactor, scalar_config
from recorder.paths import make_trace_dir, new_trace_path
from recorder.schema import Client, End, Footer, Header, Record, RecordType, Snapshot
from recorder.writer import TraceSink, TraceWriter

log = logging.getLogger("schedtop.recorder")

DEFAULT_SNAPSHOT_INTERVAL = 256
# The flush timer of open_recording's and a server's recorders: a hung engine that is
# then killed loses at most this much of its last steps (docs/trace-format.md).
FLUSH_INTERVAL_S = 1.0
# A live recording (open_recording's default: `run`, `sim`, `demo`) writes its steps in
# batches rather than at every step's end: one write(2) per step was about a fifth of the
# recorder's cost on the simulated engine (docs/benchmarks.md, Recorder). The engine's
# thread writes at the end of the first step LIVE_WRITE_S after the last write; the flush
# timer (LIVE_FLUSH_S, waking an interval after the last write) writes only when nothing
# was written for half an interval, so only for an engine that stopped stepping (a
# timer's write costs a wake-up of its thread besides). A step so reaches the file about
# LIVE_WRITE_S after it ends, and at most LIVE_FLUSH_S (plus a wake-up), however the
# engine goes on or hangs; the viewer looks for new records every 50 ms
# (tui.session.POLL_S). Its steps are recorded at those writes, together
# (RecorderOptions.batch_s).
LIVE_FLUSH_S = 0.04
LIVE_WRITE_S = 0.01
# The default replay-work budget between snapshots: per pool block, and at least this much
# (below it a seek costs a few ms whatever the spacing; see default_snapshot_work).
SNAPSHOT_WORK_PER_BLOCK = 3
MIN_SNAPSHOT_WORK = 16384
# With a snapshot budget, snapshots are at least this many steps apart however cheap.
MIN_BUDGET_STEPS = 64
# With `batch_s`, steps waiting to be compacted and encoded together: at most this many.
MAX_BATCH = 64


def default_snapshot_work(num_blocks: int) -> int:
    """The replay work after which a snapshot is due. Loading a snapshot costs about as
    much as replaying 1.5 units per pool block (measured: docs/benchmarks.md, Replays), so
    at 3 per block a seek costs at most about three snapshot loads however heavy the
    steps, and snapshot bytes stay near the steps' own (a snapshot is mostly its cached
    blocks' hashes, and a heavy step moves blocks)."""
    return max(MIN_SNAPSHOT_WORK, SNAPSHOT_WORK_PER_BLOCK * num_blocks)


def replay_work(step: Step) -> int:
    """What a reader does to apply `step`, in units of about one scheduled request or one
    block moved (docs/trace-format.md, section 1)."""
    return (
        1
        + step.num_decodes
        + len(step.scheduled)
        + len(step.kv_events.block_ids)
        + len(step.arrivals)
        + len(step.finishes)
        + len(step.preemptions)
    )


def steady_fields(report: Step, time_ns: int, redact: bool) -> tuple[Any, ...]:
    """The fields of a steady step's record (`StepCompactor.is_steady`), straight from the
    report, in encode_steady's order: a batch can keep these instead of the report."""
    return (
        report.step,
        time_ns,
        report.schedule_ns,
        report.update_ns,
        report.token_budget,
        len(report.scheduled),
        None,  # sample_counts: one sample each in a steady step
        None if redact else report.sampled_tokens,
        report.kv_events,
        report.free_blocks_after_schedule,
        report.free_blocks,
        report.work_ns,
    )


def steady_body(report: Step, time_ns: int, redact: bool) -> bytes:
    """The record of a steady step: the bytes the general encoder would write for it,
    without building its Step."""
    return encode_steady(*steady_fields(report, time_ns, redact))


class RecordedEngine(Protocol):
    """What a Recorder reads of the engine it records: schedtop's EngineCore, or the tap
    inside another engine's scheduler (recorder.vllm, recorder.sglang), which answers for
    that engine in schedtop's terms."""

    sink: EventSink  # where the engine reports its steps; the recorder installs itself here

    @property
    def config(self) -> EngineConfig: ...

    @property
    def step_index(self) -> int: ...  # the next step's index

    @property
    def has_unreported(self) -> bool: ...  # arrivals or aborts no step has reported yet

    @property
    def arrival_clock(self) -> Callable[[], float] | None: ...  # None: not the engine's

    def describe(self) -> tuple[str, str]: ...  # (engine, model), as the header names them

    def snapshot(self) -> Snapshot: ...


class TapEngine:
    """The RecordedEngine of a tap inside another engine's scheduler (recorder.vllm,
    recorder.sglang): the tap keeps `config`, `description` and `next_step`, and answers
    `snapshot()` from its own state."""

    config: EngineConfig  # the other engine's settings under schedtop's names
    description: tuple[str, str]  # (engine, model), as the header names them
    next_step: int
    sink: EventSink = NULL_SINK  # the Recorder installs itself; nothing is downstream
    # No arrival clock, so no Header.arrival_origin_ns; the estimate from the steps
    # (docs/metrics.md) puts each arrival at or before its step. vLLM stamps arrival_time
    # in its front end, before tokenizing and handing the request to the engine core,
    # which sees it milliseconds later; placed exactly, whatif's self-prediction admits a
    # request a step before vLLM could (measured: step 0 differed).
    arrival_clock: Callable[[], float] | None = None
    has_unreported = False  # a tap starts recording with its scheduler, before any request

    @property
    def step_index(self) -> int:
        return self.next_step

    def describe(self) -> tuple[str, str]:
        return self.description

    def snapshot(self) -> Snapshot:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class RecorderOptions:
    """How a Recorder records (every field has the default of a plain recording).

    A snapshot follows a step when `snapshot_interval` steps, or `snapshot_work` units of
    replay work (None: default_snapshot_work for the pool; 0: steps only), have passed
    since the last snapshot or the start. With a `snapshot_budget` (a share, e.g. 0.0025),
    one also follows, at least MIN_BUDGET_STEPS steps after the last, as soon as the
    engine's own time since then (the steps' schedule_ns + update_ns) is enough for the
    last snapshot's cost (CPU time, building and writing it) to be that share of it: the
    snapshots' cost is then bounded however large the KV pool (a snapshot lists every
    free and cached block) and however light the steps. With a `budget_clock` too, the
    engine's time is that clock's advance from one step's record to the next (read on the
    engine's thread, a snapshot's own cost left out) instead of the steps' schedule_ns +
    update_ns: recorder.vllm passes the engine thread's CPU time in vLLM's schedule and
    update calls, since under load a step's wall time is several times its CPU time and
    wall-placed snapshots then cost several times the budget.

    `background=True` encodes and appends the records on a thread of its own (see
    recorder.background), in order: the engine's thread only builds them. Then `flush`
    and `drain` are the ways to make what was recorded reach the sink.

    `flush_interval_s` starts the recorder's flush timer: its own thread (the encoding
    thread in the background, else one that only keeps time) writes out whatever is
    recorded and not yet in the file at least that often, steps or not. An engine that
    hangs and is then killed (SIGKILL) so loses at most that much of its last steps;
    without it, records reach the file only as the engine steps (and flushes).

    `batch_s` (with a flush timer, not in the background, without `on_step_record`):
    steps are compacted and encoded together, on the engine's thread at the end of the
    first step `batch_s` after the last batch (or of the MAX_BATCH-th step waiting, or
    of a step a snapshot follows, or before any other record), or by the flush timer
    once the engine has not stepped for a tick. Recording a step right after it is
    mostly the cost of bringing the recorder's code back into the CPU's caches after the
    engine's step; in a batch that is paid once (docs/benchmarks.md, Recorder). A record
    so reaches the sink up to `batch_s` later (open_recording: LIVE_WRITE_S, when its
    writer writes anyway); snapshots are placed and taken at their steps as before.

    A recording that fails (disk full, or a bug here) stops with one warning and never
    stops the engine, unless `strict` (tests, re-simulation) makes it raise."""

    redact_prompts: bool = False
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL
    snapshot_work: int | None = None
    snapshot_budget: float = 0.0
    model: str | None = None  # the header's model, instead of the engine's own description
    kv_pool: str = "blocks"  # "tokens": SGLang's token pool (docs/trace-format.md, 1.5)
    slot_map: bool = False  # the token pool's steps track every slot (format 1.9)
    # Another engine's own knobs, in the header's config beside schedtop's names for its
    # (recorder.sglang: SGLang's schedule policy, page size...).
    own_config: Mapping[str, Any] = field(default_factory=dict)
    strict: bool = False
    background: bool = False
    flush_interval_s: float | None = None
    batch_s: float = 0.0
    on_step_record: Callable[[Step], None] | None = None  # sees every Step record first
    clock: Callable[[], int] = time.monotonic_ns  # the steps' time_ns
    wall_clock: Callable[[], int] = time.time_ns  # the header's start time
    cpu_clock: Callable[[], int] = time.thread_time_ns  # a snapshot's cost, for the budget
    budget_clock: Callable[[], int] | None = None  # the engine's time, for the budget

    def __post_init__(self) -> None:
        if self.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval={self.snapshot_interval}: must be >= 1")
        if self.snapshot_work is not None and self.snapshot_work < 0:
            raise ValueError(f"snapshot_work={self.snapshot_work}: must be >= 0")
        if not 0 <= self.snapshot_budget < 1:
            raise ValueError(f"snapshot_budget={self.snapshot_budget}: must be in [0, 1)")
        if self.flush_interval_s is not None and not self.flush_interval_s > 0:
            raise ValueError(f"flush_interval_s={self.flush_interval_s}: must be > 0")
        if self.background and self.strict:
            raise ValueError("strict recording raises on the engine's thread: not in background")
        if self.batch_s < 0:
            raise ValueError(f"batch_s={self.batch_s}: must be >= 0")
        if self.batch_s and (self.flush_interval_s is None or self.background):
            raise ValueError(
                "batch_s needs the flush timer (flush_interval_s), which encodes what "
                "waits once the engine stops, and is not for the background"
            )


class Recorder:
    """Records every step of `engine` into `sink`, starting now, as `options` say.

    Attach it to a fresh engine, or between two steps of a running one (it then starts
    with a snapshot).

    `install=False` leaves `engine.sink` alone (an owner passes reports on itself);
    `continue_from` makes this the next segment of another recording (its clock and start
    time; refs are the engine's own, so they continue; the segment starts with a snapshot)."""

    def __init__(
        self,
        engine: RecordedEngine,
        sink: TraceSink,
        options: RecorderOptions = RecorderOptions(),
        *,
        install: bool = True,
        continue_from: Recorder | None = None,
    ) -> None:
        snapshot_work = options.snapshot_work
        if snapshot_work is None:
            snapshot_work = default_snapshot_work(engine.config.num_blocks)
        mid_run = engine.step_index > 0
        if mid_run and engine.has_unreported:
            raise ValueError(
                "attach the recorder to a fresh engine or right after a step, "
                "not after adding or aborting requests"
            )
        self.options = options
        self.engine = engine
        self.sink = sink
        self.snapshot_interval = options.snapshot_interval
        self.snapshot_work = snapshot_work
        self._work = 0  # replay work since the last snapshot
        self._steps = 0  # steps since the last snapshot
        self.snapshot_budget = options.snapshot_budget
        self._engine_ns = 0  # the engine's time since the last snapshot (see budget_clock)
        # The last snapshot's cost over the budget: the engine time that pays for the next
        # (0 before the first, which comes MIN_BUDGET_STEPS in and measures it).
        self._snapshot_due_ns = 0
        self._cpu_clock = options.cpu_clock
        self._budget_clock = options.budget_clock
        # The budget clock's reading when the last step was counted (or the last snapshot
        # was taken, or now).
        self._budget_mark = options.budget_clock() if options.budget_clock else 0
        # Copied out of the options: the steady-step path reads them on every step.
        self.strict = options.strict
        self.on_step_record = options.on_step_record
        self.error: str | None = None  # why recording stopped, once it has
        self._clock = clock = options.clock
        # The engine's arrival clock at time 0 (where the engine stamps arrivals): read
        # beside the recorder's own, it puts Arrival.arrival_time on the steps' clock.
        self._arrival_origin_ns: int | None = None
        if continue_from is None:
            self._t0 = clock()
            arrival_clock = engine.arrival_clock
            if arrival_clock is not None:
                self._arrival_origin_ns = round(arrival_clock() * 1e9)
            start_ns = options.wall_clock()
        else:
            # The next segment of one recording: the same clock and start time, so that
            # the segments put end to end read as one trace.
            self._t0 = continue_from._t0
            self._arrival_origin_ns = continue_from._arrival_origin_ns
            start_ns = continue_from.start_time_ns
        # An engine that reads its clock when a step's work ends (EngineCore.last_end), on
        # the clock it stamps arrivals with: the step's time is that reading, placed with
        # the arrivals' origin, so that a trace's latencies are the engine's to the
        # nanosecond (a server's /metrics fold the same readings: issue 24's one truth).
        # Read here instead, the time was late by however long this thread waited for the
        # interpreter after the step, milliseconds on a loaded machine.
        self._timed_engine: Any = None
        if self._arrival_origin_ns is not None and isinstance(
            getattr(engine, "last_end", None), float
        ):
            self._timed_engine = engine
        self._closed = False
        self._first_step = engine.step_index
        self._compactor = StepCompactor(engine.config.policy, options.redact_prompts)
        self._step_offsets = array("Q")
        self._step_ends = array("Q")
        self._snapshots: list[tuple[int, int]] = []
        self._counts = [0, 0, 0, 0]  # steps, arrivals, finishes, preemptions
        # With batch_s: the steps (report, time_ns) waiting to be compacted and encoded,
        # oldest first. The engine's thread appends; whoever encodes them (the engine's
        # thread or the flush timer's) holds the lock, which keeps the records in order:
        # every other record is appended under it, after what waits.
        # A steady step waits as its record's fields (STEADY_FIELDS), any other as
        # (report, time_ns); `_general_pending` says one of the latter waits.
        self._pending: deque[tuple[Any, ...]] = deque()
        self._general_pending = False
        self._pending_lock = threading.Lock()
        self._batch_ns = int(options.batch_s * 1e9)
        self._batched_ns = 0  # when the last batch was encoded (the steps' clock)
        self.header = self._header(engine, options, start_ns)
        self._append(self.header, boundary=True)
        # Started after the header: from here on only its thread appends to the sink.
        # The timer wakes an interval after the sink's last write (the background thread:
        # twice an interval) and writes out everything appended before it unless the sink
        # wrote within half an interval: a record waits at most one interval (plus a
        # wake-up) to reach the file.
        tick = None if options.flush_interval_s is None else self._timed_flush
        self._tick_s = tick_s = (options.flush_interval_s or 0.0) / 2
        self._bg = Background(tick=tick, tick_s=tick_s) if options.background else None
        # Without the background thread, a thread that only keeps time; it flushes the
        # sink from there, so the sink's appends take a lock from now on.
        self._timer: _Ticker | None = None
        if tick is not None and not options.background:
            share = getattr(sink, "share_with_timer", None)
            if share is not None:
                share()
            self._timer = _Ticker(self._timed_flush, tick_s)
        if mid_run:
            snap = engine.snapshot()
            self._compactor.adopt(snap)
            self._write_snapshot(snap)
        self._downstream: EventSink = NULL_SINK
        if install:
            self._downstream = engine.sink
            engine.sink = self

    @property
    def path(self) -> Path | None:
        """The trace file, when the sink is one."""
        return getattr(self.sink, "path", None)

    @property
    def start_time_ns(self) -> int:
        """The wall clock (Unix ns) when the recording started."""
        return self.header.start_time_ns

    @property
    def elapsed_ns(self) -> int:
        """Now, on the clock of the step records' time_ns."""
        return self._clock() - self._t0

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
                self._failed(report.step, e)
        self._downstream.on_step(report)

    def on_steady_step(
        self,
        step: int,
        schedule_ns: int,
        update_ns: int,
        token_budget: int,
        num_decodes: int,
        sample_counts: tuple[int, ...] | None,
        sampled_tokens: tuple[int, ...],
        kv_events: KVEvents,
        free_blocks_after_schedule: int,
        free_blocks: int,
        work_ns: int = 0,
    ) -> None:
        """`on_step` for a steady decode step (all `num_decodes` running requests decode,
        nothing else moves) that its reporter has made compact already (recorder.vllm,
        where a step's cost counts against vLLM's): the same record, encoded from its
        fields, without building it or passing it through the compactor."""
        if self.error is not None:
            return
        fields = [
            step,
            0,  # time_ns: the recorder's clock, read below
            schedule_ns,
            update_ns,
            token_budget,
            num_decodes,
            sample_counts,
            sampled_tokens,
            kv_events,
            free_blocks_after_schedule,
            free_blocks,
            work_ns,
        ]
        # In the background with no on_step_record, the compactor is the encoding
        # thread's: _append_steady checks the step there, in order.
        deferred = self._bg is not None and self.on_step_record is None
        if self._downstream is not NULL_SINK or (
            not deferred and num_decodes != len(self._compactor.running)
        ):
            # Not a steady step after all: the compactor says what is wrong with it.
            self.on_step(_steady_step(fields))
            return
        try:
            if self.sink.error is not None:
                self.error = self.sink.error
                return
            fields[_TIME] = self._clock() - self._t0
            self._record_steady(fields)
        except Exception as e:
            self._failed(step, e)

    def _record_steady(self, fields: list[Any]) -> None:
        """Record a steady decode step from its fields (in STEADY_FIELDS order, time_ns
        read): encoded straight from them, no Step built unless on_step_record wants one."""
        if self._compactor.redact:
            fields[_TOKENS] = None
        # The work is replay_work's for this record: 1 + the decodes + the blocks moved.
        # Counted only when snapshots are placed by work: recorder.vllm's KV events are
        # built on the encoding thread, and reading them here would build them on this one.
        work = 1 + fields[_DECODES] + len(fields[_KV].block_ids) if self.snapshot_work else 0
        due = self._due(work, fields[_SCHED] + fields[_UPDATE])
        if self.on_step_record is not None:
            self.on_step_record(_steady_step(fields))
        if self._bg is not None:
            self._bg.put(self._append_steady, fields, not due, self.on_step_record is None)
        elif self._batch_ns:
            with self._pending_lock:  # after the steps waiting, and in order
                self._encode_pending(self._now_ns())
                self._append_steady(fields, not due)
        else:
            self._append_steady(fields, not due)
        self._written(due)

    def _append_steady(self, fields: list[Any], boundary: bool, check: bool = False) -> None:
        """`check`: on the thread that owns the compactor, whether the step is steady
        after all (else the compactor says what is wrong with it, as on_steady_step)."""
        try:
            if check and fields[_DECODES] != len(self._compactor.running):
                rtype, body = encode(self._compactor.compact(_steady_step(fields), fields[_TIME]))
            else:
                rtype, body = RecordType.STEP, encode_steady(*fields)
            self._index_step(self.sink.append(rtype, body, boundary=boundary))
        except Exception as e:
            self._failed(fields[0], e)

    def _failed(self, step: int, e: Exception) -> None:
        """A recording that fails stops, with one warning (the engine goes on)."""
        if self.strict:
            raise e
        log.exception("recording failed at step %d", step)
        self.error = f"step {step}: {type(e).__name__}: {e}"

    def on_client(self, report: Client) -> None:
        """A server's view of one HTTP request: a CLIENT record between two steps, written
        as the server made it but for where it falls in the trace."""
        if self.error is None and not self._closed:
            try:
                after = self.engine.step_index - 1
                record = replace(report, after_step=after, time_ns=self._now_ns())
                self._put(record, boundary=True)
            except Exception as e:
                if self.strict:
                    raise
                log.exception("recording a client report failed")
                self.error = f"client record: {type(e).__name__}: {e}"
        report_client(self._downstream, report)

    def _now_ns(self) -> int:
        return self._clock() - self._t0

    def flush(self) -> None:
        """Have the sink write what it holds (TraceWriter.flush). In the background, the
        flush is queued behind the records so far and the thread is woken, not waited
        for: see `drain`."""
        flush = getattr(self.sink, "flush", None)
        if self._bg is None:
            self._flush_pending()
            if flush is not None:
                flush()
            return
        if flush is not None:
            self._bg.put(flush)
        self._bg.wake()

    def wake(self) -> None:
        """In the background: have the thread append what is queued now, without a
        flush (a live viewer's stream is fed as records are appended, not written)."""
        if self._bg is not None:
            self._bg.wake()

    def _timed_flush(self) -> float:
        """The flush timer's tick (on the recorder's own thread, not the engine's): writes
        out what is buffered unless the sink wrote in the last tick's time. Steps waiting
        to be encoded (batch_s) are encoded here once the engine's thread has not for a
        tick: it stopped stepping. The writes of an engine that steps so stay on its
        thread, where they cost less than a wake-up of this one.

        Returns when the next tick is due (the _Ticker's; the background thread ticks
        twice an interval): an interval after the sink's last write, or after now. A
        record appended after that write then waits at most one interval (plus a
        wake-up), and an engine that writes every LIVE_WRITE_S wakes this thread about
        once an interval, not twice (measured: 130-190 µs of CPU a wake at a load of
        5-7 here, and the interpreter handed over and back)."""
        tick_s = self._tick_s
        if self._pending and self._now_ns() - self._batched_ns >= tick_s * 1e9:
            self._flush_pending()
        sink = self.sink
        flush = getattr(sink, "flush_buffered", None)
        if flush is not None and self.error is None:
            flush(tick_s)
        since_write = getattr(sink, "since_write", None)
        if since_write is None:
            return tick_s
        interval = 2 * tick_s
        wait = interval - since_write()
        # Nothing written for an interval (idle: nothing to write), or a clock gone back.
        return interval if not 0 < wait <= interval else max(wait, tick_s / 4)

    def drain(self) -> None:
        """Wait until every record so far is in the sink (in the background: appended)."""
        if self._bg is not None:
            self._bg.drain()
        else:
            self._flush_pending()

    @property
    def background_thread(self) -> Any:
        """The thread that encodes and appends the records (None: the engine's own)."""
        return None if self._bg is None else self._bg.thread

    @property
    def own_threads(self) -> tuple[Any, ...]:
        """The recorder's own threads (the encoding thread, or the flush timer): what it
        costs beyond the engine's thread (bench/recorder_bench.py counts their CPU)."""
        return tuple(b.thread for b in (self._bg, self._timer) if b is not None)

    def close(self, stopped: str = "") -> None:
        """Write the footer (if recording went well), flush, fsync and close. Idempotent.
        `stopped`: why recording stops while the engine goes on, kept in the footer so
        that readers (`schedtop info`) can say the trace ends early and why."""
        if self._closed:
            return
        self._closed = True
        if self.engine.sink is self:
            self.engine.sink = self._downstream
        if self._timer is not None:
            self._timer.close()
        if self._bg is not None:
            self._bg.close()  # every record queued is appended: the footer indexes them
        try:
            self._flush_pending()  # before the footer, which indexes them
            if self.error is None and self.sink.error is None:
                offset = self._append(self._footer(stopped))
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
        timed = self._timed_engine
        if timed is None:
            time_ns = self._clock() - self._t0
        else:
            time_ns = round(timed.last_end * 1e9) - self._arrival_origin_ns
        if self._batch_ns and self.on_step_record is None:
            self._batch(report, time_ns)
            return
        if self._bg is not None and self.on_step_record is None:
            # Nobody sees the compacted record now: compacting it is the encoding thread's
            # job too (the compactor is then that thread's alone). Its replay work is the
            # report's (see _batch).
            work = replay_work(report) if self.snapshot_work else 0
            due = self._due(work, report.schedule_ns + report.update_ns)
            self._bg.put(self._encode_report, report, time_ns, not due)
            self._written(due, len(report.arrivals), len(report.finishes), len(report.preemptions))
            return
        compactor = self._compactor
        # Most steps of a busy engine: the path of on_steady_step, which costs what the
        # record holds (no Step built, no general encoder over its 28 fields).
        if not report.num_decodes and compactor.is_steady(report):
            if self._bg is None and self.on_step_record is None:
                self._write_steady(report, time_ns)
                return
            self._record_steady(
                [
                    report.step,
                    time_ns,
                    report.schedule_ns,
                    report.update_ns,
                    report.token_budget,
                    len(report.scheduled),
                    None,  # sample_counts: one sample each in a steady step
                    report.sampled_tokens,
                    report.kv_events,
                    report.free_blocks_after_schedule,
                    report.free_blocks,
                    report.work_ns,
                ]
            )
            return
        step = compactor.compact(report, time_ns)
        work = replay_work(step) if self.snapshot_work else 0  # as in _record_steady
        snapshot_due = self._due(work, step.schedule_ns + step.update_ns)
        if self.on_step_record is not None:
            self.on_step_record(step)
        self._put(step, not snapshot_due, self._index_step)
        counts = (len(report.arrivals), len(report.finishes), len(report.preemptions))
        self._written(snapshot_due, *counts)

    def _encode_report(self, report: Step, time_ns: int, boundary: bool) -> None:
        """Compact, encode and append one step (on the encoding thread)."""
        try:
            rtype, body = self._report_bytes(report, time_ns)
            self._index_step(self.sink.append(rtype, body, boundary=boundary))
        except Exception as e:
            self._failed(report.step, e)

    def _report_bytes(self, report: Step, time_ns: int) -> tuple[int, bytes]:
        """A step's record type and body, by the thread that owns the compactor: a steady
        step's straight from the report, any other's compacted first."""
        compactor = self._compactor
        if not report.num_decodes and compactor.is_steady(report):
            return RecordType.STEP, steady_body(report, time_ns, compactor.redact)
        return encode(compactor.compact(report, time_ns))

    def _write_steady(self, report: Step, time_ns: int) -> None:
        """_record_steady's work for a steady `report` on the engine's thread, with no
        list of fields in between: the record's bytes straight from the report."""
        work = 1 + len(report.scheduled) + len(report.kv_events.block_ids)
        due = self._due(work, report.schedule_ns + report.update_ns)
        body = steady_body(report, time_ns, self._compactor.redact)
        self._index_step(self.sink.append(RecordType.STEP, body, boundary=not due))
        self._written(due)

    def _batch(self, report: Step, time_ns: int) -> None:
        """With batch_s: `report` waits to be compacted and encoded with the next steps'
        (_encode_pending), all but what places snapshots, which is counted now.

        Right after the engine's step the recorder's code is out of the CPU's caches,
        where each call costs several times what it does in a loop: measured in context
        (docs/benchmarks.md, Recorder), the first step of a batch took 66 µs to encode
        and the next ones 22, 17, 15, 14; so a step costs the engine's thread only this."""
        # The compacted record's replay work is the report's: compacting moves leading
        # entries into num_decodes and leaves the other counts alone.
        due = self._due(replay_work(report), report.schedule_ns + report.update_ns)
        pending = self._pending
        compactor = self._compactor
        with self._pending_lock:
            # A steady step waits as its record's fields: the report's entries hold every
            # running request, and 64 reports kept alive cost the engine's collector and
            # allocator about 40k instructions a step (measured: docs/benchmarks.md). The
            # compactor's queues are up to date only while no other step waits (a steady
            # one changes nothing in them); the lock keeps the flush timer's encoding out.
            if not self._general_pending and not report.num_decodes and compactor.is_steady(report):
                pending.append(steady_fields(report, time_ns, compactor.redact))
            else:
                self._general_pending = True
                pending.append((report, time_ns))
            # A snapshot follows a due step: the batch goes first, its last record without
            # a boundary (the snapshot ends the flush unit).
            if due or time_ns - self._batched_ns >= self._batch_ns or len(pending) >= MAX_BATCH:
                self._encode_pending(time_ns, last_boundary=not due)
        self._written(due, len(report.arrivals), len(report.finishes), len(report.preemptions))

    def _encode_pending(self, now_ns: int, last_boundary: bool = True) -> None:
        """Compact, encode and append the steps waiting (the caller holds _pending_lock),
        in order; only the last ends a flush unit, so the writer writes the batch at
        once."""
        pending = self._pending
        self._batched_ns = now_ns
        sink = self.sink
        append, offsets, ends = sink.append, self._step_offsets, self._step_ends
        self._general_pending = False  # (the caller holds the lock: none will wait)
        while pending:
            waiting = pending.popleft()
            if self.error is not None:
                continue  # recording stopped: what waits is dropped, as later steps are
            try:
                rtype: int
                if len(waiting) != 2:  # a steady step's fields
                    rtype, body = RecordType.STEP, encode_steady(*waiting)
                else:
                    rtype, body = self._report_bytes(*waiting)
                boundary = last_boundary if not pending else False
                offsets.append(append(rtype, body, boundary=boundary))
                ends.append(sink.offset)
            except Exception as e:
                self._failed(waiting[0] if len(waiting) != 2 else waiting[0].step, e)

    def _flush_pending(self) -> None:
        """Append the steps waiting, before any other record (any thread)."""
        if self._pending:
            with self._pending_lock:
                self._encode_pending(self._clock() - self._t0)

    def _due(self, work: int, engine_ns: int) -> bool:
        """Counts a step, its replay work and the engine's time in it; whether a snapshot
        follows it."""
        self._work += work
        self._steps += 1
        if self._steps >= self.snapshot_interval or 0 < self.snapshot_work <= self._work:
            return True
        return bool(self.snapshot_budget) and self._budget_due(engine_ns)

    def _budget_due(self, engine_ns: int) -> bool:
        """With a snapshot budget: counts the engine's time in a step (counted already by
        _due or _write_steady); whether that time has paid for the next snapshot."""
        clock = self._budget_clock
        if clock is not None:  # the engine's time by its own clock, not the step's
            mark = self._budget_mark
            self._budget_mark = now = clock()
            engine_ns = now - mark
        self._engine_ns += engine_ns
        return self._steps >= MIN_BUDGET_STEPS and self._engine_ns >= self._snapshot_due_ns

    def _written(
        self, snapshot_due: bool, arrivals: int = 0, finishes: int = 0, preemptions: int = 0
    ) -> None:
        """A step record is on its way to the sink: count it, snapshot if due."""
        counts = self._counts
        counts[0] += 1
        counts[1] += arrivals
        counts[2] += finishes
        counts[3] += preemptions
        if snapshot_due:
            started = self._cpu_clock() if self.snapshot_budget else 0
            self._write_snapshot(self.engine.snapshot())
            if self.snapshot_budget:
                cost = self._cpu_clock() - started
                self._snapshot_due_ns = int(cost / self.snapshot_budget)
                if self._budget_clock is not None:  # the snapshot does not pay for itself
                    self._budget_mark = self._budget_clock()

    def _write_snapshot(self, snap: Snapshot) -> None:
        self._work = self._steps = self._engine_ns = 0
        # Encoded here even in the background: a snapshot's cost, which places the next
        # one under a budget, is measured on this thread.
        self._put(snap, True, partial(self._index_snapshot, snap.step), encode(snap))

    # -- appending: on the engine's thread, or in order on the background one ------------------

    def _put(
        self,
        record: Record,
        boundary: bool = False,
        then: Callable[[int], None] | None = None,
        encoded: tuple[int, bytes] | None = None,
    ) -> None:
        """Append `record` (`encoded`: its type and body, encoded already); `then(offset)`
        indexes it."""
        if self._bg is not None:
            self._bg.put(self._append_then, record, boundary, then, encoded)
        elif self._batch_ns:
            with self._pending_lock:  # after the steps waiting, and in order
                self._encode_pending(self._now_ns())
                self._append_then(record, boundary, then, encoded)
        else:
            self._append_then(record, boundary, then, encoded)

    def _append_then(
        self,
        record: Record,
        boundary: bool,
        then: Callable[[int], None] | None,
        encoded: tuple[int, bytes] | None,
    ) -> None:
        try:
            rtype, body = encoded or encode(record)
            offset = self.sink.append(rtype, body, boundary=boundary)
            if then is not None:
                then(offset)
        except Exception as e:
            self._failed(getattr(record, "step", getattr(record, "after_step", -1)), e)

    def _index_step(self, offset: int) -> None:
        """The step record just appended at `offset` (it ends where the next begins)."""
        self._step_offsets.append(offset)
        self._step_ends.append(self.sink.offset)

    def _index_snapshot(self, step: int, offset: int) -> None:
        self._snapshots.append((step, offset))

    def _append(self, record: Record, boundary: bool = False) -> int:
        rtype, body = encode(record)
        if self._batch_ns:
            with self._pending_lock:  # after the steps waiting, and in order
                self._encode_pending(self._now_ns())
                return self.sink.append(rtype, body, boundary=boundary)
        return self.sink.append(rtype, body, boundary=boundary)

    def _header(self, engine: RecordedEngine, options: RecorderOptions, start_ns: int) -> Header:
        cfg = engine.config
        name, model = engine.describe()
        return Header(
            engine=name,
            model=model if options.model is None else options.model,
            config=scalar_config({**cfg.to_dict(), **options.own_config}),
            block_size=cfg.block_size,
            num_blocks=cfg.num_blocks,
            policy=cfg.policy,
            start_time_ns=start_ns,
            host=socket.gethostname(),
            redacted=options.redact_prompts,
            first_step=engine.step_index,
            snapshot_interval=self.snapshot_interval,
            snapshot_work=self.snapshot_work,
            arrival_origin_ns=self._arrival_origin_ns,
            kv_pool=options.kv_pool,
            slot_map=options.slot_map,
        )

    def _footer(self, stopped: str = "") -> Footer:
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
            stopped=stopped,
        )


class _Ticker:
    """The flush timer of a recorder without a background thread: a thread that calls
    `tick` when the last call asked (its return: seconds from now), sleeping in between
    in one call that releases the interpreter (a lock it gets only at close). A tick
    costs little beyond the wake-up; the Background thread's condition-variable loop,
    which also runs jobs, took more per tick."""

    def __init__(self, tick: Callable[[], float], first_s: float) -> None:
        self._tick = tick
        self._stop = threading.Lock()
        self._stop.acquire()
        self.thread = threading.Thread(
            target=self._run, args=(first_s,), name="trace-flush-timer", daemon=True
        )
        self.thread.start()

    def _run(self, wait_s: float) -> None:
        stop, tick = self._stop, self._tick
        while not stop.acquire(timeout=wait_s):
            try:
                wait_s = tick()
            except Exception:
                log.exception("the recorder's timed flush failed")

    def close(self) -> None:
        """Stop ticking (a tick in progress finishes first). Idempotent."""
        if self.thread.is_alive():
            self._stop.release()
            self.thread.join()


# Recorder._record lists a steady step's fields in this order.
assert STEADY_FIELDS == (
    "step",
    "time_ns",
    "schedule_ns",
    "update_ns",
    "token_budget",
    "num_decodes",
    "sample_counts",
    "sampled_tokens",
    "kv_events",
    "free_blocks_after_schedule",
    "free_blocks",
    "work_ns",
)
_TIME, _TOKENS = STEADY_FIELDS.index("time_ns"), STEADY_FIELDS.index("sampled_tokens")
_SCHED, _UPDATE = STEADY_FIELDS.index("schedule_ns"), STEADY_FIELDS.index("update_ns")
_DECODES, _KV = STEADY_FIELDS.index("num_decodes"), STEADY_FIELDS.index("kv_events")


def _steady_step(fields: list[Any]) -> Step:
    """The Step record of a steady step's fields (in STEADY_FIELDS order)."""
    named: dict[str, Any] = dict(zip(STEADY_FIELDS, fields))
    return Step(**named)


def open_recording(
    engine: RecordedEngine,
    path: str | Path | None = None,
    *,
    kind: str = "run",
    redact_prompts: bool = False,
    live: bool = True,
    snapshot_interval: int = DEFAULT_SNAPSHOT_INTERVAL,
    model: str | None = None,
    background: bool = False,
) -> Recorder:
    """Record `engine` into `path`, or into a new file in the default trace directory
    (see recorder.paths) named after `kind` ("run", "sim", "demo"). `live` writes every
    step about LIVE_WRITE_S after its end (LIVE_FLUSH_S at most), so that `schedtop live`
    follows the engine with no visible delay (else within FLUSH_INTERVAL_S).
    `background` encodes and writes on the recorder's own thread (RecorderOptions): less
    on the engine's thread, but more CPU in all, since by the time that thread runs, the
    steps' records are no longer in cache (measured on the simulated engine: a steady
    step's encoding cost 57-84 us there against 20-28 us on the engine's thread just
    after the step; docs/benchmarks.md, Recorder). Raises RecordingError when the file
    cannot be created."""
    if path is None:
        path = new_trace_path(kind)
        make_trace_dir(path.parent)
    interval = LIVE_FLUSH_S if live else FLUSH_INTERVAL_S
    # Written at a step's end once LIVE_WRITE_S (not live: the interval) has passed since
    # the last write; the recorder's flush timer writes out the rest when the engine
    # stops stepping (idle or hung: a kill then loses at most the last `interval`).
    writer = TraceWriter(path, live=False, flush_interval_s=LIVE_WRITE_S if live else interval)
    try:
        options = RecorderOptions(
            redact_prompts=redact_prompts,
            snapshot_interval=snapshot_interval,
            model=model,
            flush_interval_s=interval,
            background=background,
            # Steps recorded together at the writer's own pace (its writes are
            # LIVE_WRITE_S apart at most as the engine steps): no later in the file.
            batch_s=0.0 if background else LIVE_WRITE_S,
        )
        return Recorder(engine, writer, options)
    except BaseException:
        writer.close()
        raise
