"""Export a trace to the Chrome trace-event format, for Perfetto and chrome://tracing.

    export_perfetto("run.trace", "run.json")   # then open run.json in ui.perfetto.dev

One pass over the trace with the reducer: memory follows the number of unfinished
requests, not the number of steps, and events are written as they are known (the
format does not need them in time order). docs/export.md describes the layout:

- process "engine": thread "steps" (one slice per step, its decisions and timings as
  args), thread "phases" (schedule, runner and update slices inside each step), and
  the counters "KV free blocks", "queue running/waiting", "budget use";
- process "requests": one thread per request, named by its id, in arrival order, with
  queued, prefill, decode and preempted slices and a finish instant;
- a flow arrow from the step of each preemption to the victim's resumed prefill.

Time: a step's slice runs from the previous step's end to its own `time_ns` (ns since
the recording started). A trace without step times (time_ns 0) gets 1 ms per step, and
the metadata says so.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.multi import open_trace
from recorder.reader import Cut, TraceReader
from recorder.schema import (
    Admission,
    Header,
    Kind,
    Reason,
    Snapshot,
    Status,
    Step,
    Timing,
)
from replays.chrome_trace import (
    Event,
    EventWriter,
    ExportError,
    atomic_events,
    complete,
    counter,
    flow,
    instant,
    metadata,
    us,
)
from replays.reducer import StepView, apply_with_view
from replays.state import State

__all__ = ["ExportError", "ExportSummary", "export_perfetto"]

ENGINE_PID, REQUESTS_PID = 1, 2
STEPS_TID, PHASES_TID, IDLE_TID = 1, 2, 3
REQUEST_TID_BASE = 1000  # request ref r is thread 1000 + r: clear of the engine's threads
IDLE_MIN_NS = 1_000_000  # a wait before a step this long is drawn as an idle slice
SYNTHETIC_STEP_NS = 1_000_000  # the clock of a trace without step times
TIMING_WINDOW = 32  # steps a slice waits for runner timings, which may arrive late


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What an export wrote."""

    path: Path  # the output file
    events: int  # trace events written
    steps: int  # step records exported
    requests: int  # request tracks
    preemptions: int  # preempted slices
    flows: int  # preemption -> resumption arrows
    synthetic_clock: bool  # the trace had no step times: 1 ms per step

    def format(self) -> str:
        """What `schedtop export` prints of it."""
        return (
            f"perfetto: {self.events} events ({self.steps} steps, {self.requests} "
            f"requests, {self.preemptions} preemptions) -> {self.path}"
        )


def export_perfetto(
    source: TraceReader | str | os.PathLike[str], out_path: str | os.PathLike[str]
) -> ExportSummary:
    """Write the trace `source` (a path, or an open reader, read from its start) to
    `out_path` as Chrome trace-event JSON. Raises TraceError for a bad trace and
    ExportError when the output cannot be written; either way `out_path` is left as it
    was."""
    out = Path(out_path)
    if isinstance(source, TraceReader):
        return _export(source, out)
    with open_trace(source) as reader:
        return _export(reader, out)


def _export(reader: TraceReader, out: Path) -> ExportSummary:
    if out.exists() and reader.path.exists() and out.samefile(reader.path):
        raise ExportError(f"{out}: is the trace being exported; choose another output")
    with atomic_events(out) as writer:
        exporter = _Exporter(reader.header, writer)
        for entry in reader.entries():
            exporter.feed(entry.record, entry.offset)
        exporter.close(reader.cut)
        writer.finish(exporter.other_data(reader))
        return ExportSummary(
            out,
            writer.count,
            exporter.num_steps,
            exporter.num_requests,
            exporter.num_preemptions,
            exporter.num_flows,
            bool(exporter.synthetic),
        )


@dataclass(slots=True)
class _Decode:
    """An open decode slice: consecutive steps with a DECODE or SPEC entry."""

    start: int  # ns
    end: int  # ns: the end of its last step
    first_step: int
    last_step: int
    tokens: int = 0
    spec_tokens: int = 0
    accepted: int = 0


@dataclass(slots=True)
class _Track:
    """One request's thread while the request is unfinished."""

    tid: int
    name: str  # the request id
    waiting: str | None = None  # an open "queued" or "preempted" slice, else None
    since: int = 0  # ns: when the open slice began
    args: dict[str, Any] = field(default_factory=dict)  # the open slice's args
    decode: _Decode | None = None
    preempted_in: tuple[int, int, int] | None = None  # (step, start, end) of the preemption


@dataclass(slots=True)
class _StepSlice:
    """A step slice held back for a while, until its runner timings have come."""

    step: int
    start: int  # ns
    end: int  # ns
    args: dict[str, Any]
    schedule_ns: int
    update_ns: int
    timing: Timing | None = None


class _Exporter:
    """The layout: turns each step (spelled out by the reducer) into trace events."""

    def __init__(self, header: Header, writer: EventWriter) -> None:
        self.header = header
        self.w = writer
        self.state: State | None = None
        self.tracks: dict[int, _Track] = {}  # unfinished requests by ref
        self.decoding: dict[int, _Track] = {}  # those with an open decode slice
        self.pending: OrderedDict[int, _StepSlice] = OrderedDict()  # by step
        self.prev_end = 0  # ns: the end of the previous step (0: recording start)
        self.synthetic: bool | None = None  # decided by the first step
        self.clamped = 0  # steps whose time_ns went backwards
        self.late_timings = 0  # timings whose step had already been written
        self.num_steps = self.num_requests = self.num_preemptions = self.num_flows = 0
        self.first: int | None = None
        self.last: int | None = None
        self._names()

    # -- records -----------------------------------------------------------------------------

    def feed(self, record: object, offset: int) -> None:
        if isinstance(record, Snapshot):
            if self.state is None:  # a mid-run recording starts from its snapshot
                self.state = State.from_snapshot(self.header, record)
                for ref in sorted(self.state.requests):
                    self._adopt(ref)
        elif isinstance(record, Step):
            if self.state is None:
                self.state = State.initial(self.header)
            if self.first is None:
                self.first = record.step
                self._counters(self.prev_end, len(self.state.free))  # before any step
            self._step(apply_with_view(self.state, record, offset))

    def _step(self, view: StepView) -> None:
        rec, state = view.record, self.state
        assert state is not None
        k, start = rec.step, self.prev_end
        end = self._end_of(rec)
        if rec.work_ns and not self.synthetic and end - rec.work_ns - start >= IDLE_MIN_NS:
            # The wait before the step is idle, not the step's work (format 1.4); the
            # host's few µs between two busy steps stay in the step's slice.
            start = end - rec.work_ns
            self._emit(complete("idle", "idle", self.prev_end, start, ENGINE_PID, IDLE_TID, {}))
        for arrival in rec.arrivals:
            self._arrive(arrival.ref, arrival.request_id, start, k)
        preempted: dict[str, Any] = {}
        for p in rec.preemptions:
            t = self._track(p.victim)
            self._close_decode(p.victim, t)
            t.waiting, t.since, t.preempted_in = "preempted", start, (k, start, end)
            t.args = {
                "step": k,
                "for_request": self._name(p.for_request),
                "tokens_lost": p.tokens_lost,
            }
            preempted[t.name] = dict(t.args)  # t.args grows until the request resumes
            self.num_preemptions += 1
        admitted: dict[int, Admission] = {}
        for a in rec.admissions:
            admitted[a.ref] = a
            self._admit(a, k, start, end)
        accepted = {s.ref: s.accepted for s in rec.spec_accepted}
        prefill = decode = drafts = 0
        for e in view.scheduled:
            t = self._track(e.ref)
            if e.kind in (Kind.DECODE, Kind.SPEC):
                decode += e.num_tokens - e.num_spec_tokens
                drafts += e.num_spec_tokens
                self._extend_decode(
                    e.ref, t, k, start, end, e.num_tokens, e.num_spec_tokens, accepted.get(e.ref, 0)
                )
                continue
            prefill += e.num_tokens
            self._close_decode(e.ref, t)
            args: dict[str, Any] = {
                "step": k,
                "tokens": e.num_tokens,
                "computed_before": e.num_computed_before,
                "final": e.kind == Kind.PREFILL,
            }
            if e.ref in admitted:
                args["cached_tokens"] = admitted[e.ref].cached_tokens
                args["resumed"] = admitted[e.ref].resumed
            self._emit(complete("prefill", "request", start, end, REQUESTS_PID, t.tid, args))
        for f in rec.finishes:
            self._finish(
                f.ref, f.status, f.message, k, start if f.status == Status.FINISHED_ABORTED else end
            )
        for ref, t in list(self.decoding.items()):
            if t.decode is not None and t.decode.last_step != k:
                self._close_decode(ref, t)
        self._counters(end, rec.free_blocks, rec.num_scheduled_tokens, rec.token_budget)
        self._hold_step(view, start, end, prefill, decode, preempted)
        if drafts:
            held = self.pending[rec.step].args
            held["spec_tokens"] = drafts
            held["drafts_accepted"] = sum(accepted.values())
        self.prev_end = end
        self.last = k
        self.num_steps += 1

    def _end_of(self, rec: Step) -> int:
        if self.synthetic is None:
            self.synthetic = rec.time_ns == 0
        if self.synthetic:
            return self.prev_end + SYNTHETIC_STEP_NS
        if rec.time_ns < self.prev_end:  # a hostile or broken clock: keep slices >= 0
            self.clamped += 1
            return self.prev_end
        return rec.time_ns

    # -- requests ----------------------------------------------------------------------------

    def _arrive(self, ref: int, request_id: str, at: int, step: int) -> _Track:
        t = _Track(REQUEST_TID_BASE + ref, request_id, "queued", at, {"arrival_step": step})
        self.tracks[ref] = t
        self.num_requests += 1
        self._emit(metadata("thread_name", REQUESTS_PID, t.tid, {"name": request_id}))
        self._emit(metadata("thread_sort_index", REQUESTS_PID, t.tid, {"sort_index": ref}))
        return t

    def _adopt(self, ref: int) -> _Track:
        """A request the trace did not see arrive (it starts mid-run): its track starts
        in the state the snapshot gives it."""
        assert self.state is not None
        r = self.state.requests.get(ref)
        if r is None:  # the reducer accepted the record, so this cannot be; stay drawable
            return self._arrive(ref, str(ref), self.prev_end, -1)
        t = self._arrive(ref, r.request_id, self.prev_end, r.arrival_step)
        t.args["before_recording"] = True
        if r.status == Status.PREEMPTED:
            t.waiting = "preempted"
        elif r.status != Status.WAITING:
            t.waiting = None
        return t

    def _track(self, ref: int) -> _Track:
        t = self.tracks.get(ref)
        return t if t is not None else self._adopt(ref)

    def _name(self, ref: int) -> str:
        t = self.tracks.get(ref)
        return t.name if t is not None else str(ref)

    def _admit(self, a: Admission, step: int, start: int, end: int) -> None:
        t = self._track(a.ref)
        if t.waiting == "queued":
            t.args.update(admitted_step=step, cached_tokens=a.cached_tokens)
        elif t.waiting == "preempted":
            t.args["resumed_step"] = step
            if t.preempted_in is not None:
                self._flow(t, t.preempted_in, (start, end))
        self._close_waiting(t, start)
        t.preempted_in = None

    def _close_waiting(self, t: _Track, at: int, **extra: Any) -> None:
        if t.waiting is not None:
            t.args.update(extra)
            self._emit(complete(t.waiting, "request", t.since, at, REQUESTS_PID, t.tid, t.args))
            t.waiting, t.args = None, {}

    def _flow(self, t: _Track, source: tuple[int, int, int], dest: tuple[int, int]) -> None:
        """An arrow from the step slice that preempted `t` to its resumed prefill slice.
        Each end sits mid-slice, so that it binds to that slice whatever order a viewer
        gives events sharing a timestamp."""
        self.num_flows += 1
        _, s0, s1 = source
        self._emit(flow("s", "preemption", self.num_flows, _mid(s0, s1), ENGINE_PID, STEPS_TID))
        self._emit(flow("f", "preemption", self.num_flows, _mid(*dest), REQUESTS_PID, t.tid))

    def _extend_decode(
        self,
        ref: int,
        t: _Track,
        step: int,
        start: int,
        end: int,
        tokens: int,
        spec: int,
        accepted: int,
    ) -> None:
        d = t.decode
        if d is not None and d.last_step != step - 1:
            self._close_decode(ref, t)
            d = None
        if d is None:
            d = t.decode = _Decode(start, end, step, step)
            self.decoding[ref] = t
        d.end, d.last_step = end, step
        d.tokens += tokens
        d.spec_tokens += spec
        d.accepted += accepted

    def _close_decode(self, ref: int, t: _Track) -> None:
        d = t.decode
        if d is None:
            return
        args: dict[str, Any] = {
            "first_step": d.first_step,
            "last_step": d.last_step,
            "steps": d.last_step - d.first_step + 1,
            "tokens": d.tokens,
        }
        name = "decode"
        if d.spec_tokens:
            # Its own name, so that Perfetto colours and filters speculative decoding apart.
            name = "spec decode"
            args.update(spec_tokens=d.spec_tokens, drafts_accepted=d.accepted)
        self._emit(complete(name, "request", d.start, d.end, REQUESTS_PID, t.tid, args))
        t.decode = None
        self.decoding.pop(ref, None)

    def _finish(self, ref: int, status: int, message: str, step: int, at: int) -> None:
        t = self._track(ref)
        self._close_decode(ref, t)
        self._close_waiting(t, max(at, t.since))
        args: dict[str, Any] = {"step": step, "reason": _enum_name(Status, status)}
        if message:
            args["message"] = message
        self._emit(instant("finish", "request", at, REQUESTS_PID, t.tid, args))
        del self.tracks[ref]

    # -- the engine --------------------------------------------------------------------------

    def _counters(self, at: int, free: int, scheduled: int | None = None, budget: int = 0) -> None:
        assert self.state is not None
        self._emit(counter("KV", at, ENGINE_PID, {"free blocks": free}))
        self._emit(
            counter(
                "queue",
                at,
                ENGINE_PID,
                {"running": len(self.state.running), "waiting": len(self.state.waiting)},
            )
        )
        if scheduled is not None:
            use = scheduled / budget if budget else 0.0
            self._emit(counter("budget", at, ENGINE_PID, {"use": round(use, 4)}))

    def _hold_step(
        self,
        view: StepView,
        start: int,
        end: int,
        prefill: int,
        decode: int,
        preempted: dict[str, Any],
    ) -> None:
        rec, state = view.record, self.state
        assert state is not None
        args: dict[str, Any] = {
            "step": rec.step,
            "scheduled_tokens": rec.num_scheduled_tokens,
            "token_budget": rec.token_budget,
            "prefill_tokens": prefill,
            "decode_tokens": decode,
            "requests_scheduled": len(view.scheduled),
            "arrivals": len(rec.arrivals),
            "admissions": len(rec.admissions),
            "preemptions": len(rec.preemptions),
            "finishes": len(rec.finishes),
            "running": len(state.running),
            "waiting": len(state.waiting),
            "free_blocks": rec.free_blocks,
        }
        if rec.time_ns:
            args["time_ns"] = rec.time_ns
        if rec.work_ns:
            args["work_ns"] = rec.work_ns
        if rec.schedule_ns:
            args["schedule_ns"] = rec.schedule_ns
        if rec.update_ns:
            args["update_ns"] = rec.update_ns
        for what, stop in (("running_stop", rec.running_stop), ("waiting_stop", rec.waiting_stop)):
            if stop is not None:
                args[what] = (
                    f"{_enum_name(Reason, stop.head)}, then {_enum_name(Reason, stop.rest)}"
                )
        if preempted:
            args["preempted"] = preempted
        self.pending[rec.step] = _StepSlice(
            rec.step, start, end, args, rec.schedule_ns, rec.update_ns
        )
        for timing in rec.timings:
            held = self.pending.get(timing.step)
            if held is None:
                self.late_timings += 1
            else:
                held.timing = timing
        while len(self.pending) > TIMING_WINDOW:
            self._write_step(self.pending.popitem(last=False)[1])

    def _write_step(self, s: _StepSlice) -> None:
        t, args = s.timing, s.args
        if t is not None:
            args.update(prepare_ns=t.prepare_ns, forward_ns=t.forward_ns, sample_ns=t.sample_ns)
            if t.propose_ns:
                args["propose_ns"] = t.propose_ns
            if t.attention_ns is not None:
                args["attention_ns"] = t.attention_ns
            if t.kernels:
                args["kernels"] = _kernels(t)
        self._emit(complete(f"step {s.step}", "step", s.start, s.end, ENGINE_PID, STEPS_TID, args))
        self._phases(s)

    def _phases(self, s: _StepSlice) -> None:
        """The step's parts, end to end in engine order (schedule, the runner, update),
        clipped to the step so that they nest in it; exact ns are in the step's args."""
        update_at = max(s.start, s.end - s.update_ns)
        at = s.start
        parts: list[tuple[str, int, dict[str, Any] | None]] = [("schedule", s.schedule_ns, None)]
        t = s.timing
        if t is not None:
            parts += [
                ("prepare", t.prepare_ns, None),
                ("forward", t.forward_ns, {"kernels": _kernels(t)} if t.kernels else None),
                ("sample", t.sample_ns, None),
                ("propose", t.propose_ns, None),
            ]
        for name, ns, args in parts:
            if ns <= 0:
                continue
            stop = min(at + ns, update_at)
            self._emit(complete(name, "phase", at, stop, ENGINE_PID, PHASES_TID, args))
            if name == "forward" and t is not None and t.attention_ns:
                self._emit(
                    complete(
                        "attention",
                        "phase",
                        at,
                        min(at + t.attention_ns, stop),
                        ENGINE_PID,
                        PHASES_TID,
                    )
                )
            at = stop
        if s.update_ns > 0:
            self._emit(complete("update", "phase", update_at, s.end, ENGINE_PID, PHASES_TID))

    # -- the ends of the file ----------------------------------------------------------------

    def _names(self) -> None:
        # The engine's name waits for close(): it tells whether the clock is synthetic.
        self._emit(metadata("process_name", REQUESTS_PID, REQUESTS_PID, {"name": "requests"}))
        for pid, order in ((ENGINE_PID, 0), (REQUESTS_PID, 1)):
            self._emit(metadata("process_sort_index", pid, pid, {"sort_index": order}))
        for tid, name in ((STEPS_TID, "steps"), (PHASES_TID, "phases"), (IDLE_TID, "idle")):
            self._emit(metadata("thread_name", ENGINE_PID, tid, {"name": name}))
            self._emit(metadata("thread_sort_index", ENGINE_PID, tid, {"sort_index": tid}))

    def close(self, cut: Cut | None) -> None:
        """End what is still open at the last step: requests that had not finished keep
        their slices up to there, marked unfinished."""
        while self.pending:
            self._write_step(self.pending.popitem(last=False)[1])
        for ref, t in list(self.tracks.items()):
            self._close_decode(ref, t)
            self._close_waiting(t, max(self.prev_end, t.since), unfinished=True)
        name = "engine (no step times: 1 ms per step)" if self.synthetic else "engine"
        self._emit(metadata("process_name", ENGINE_PID, ENGINE_PID, {"name": name}))

    def other_data(self, reader: TraceReader) -> dict[str, Any]:
        h = self.header
        data: dict[str, Any] = {
            "source": str(reader.path),
            "engine": h.engine,
            "model": h.model,
            "policy": h.policy,
            "host": h.host,
            "start_time_ns": h.start_time_ns,
            "steps": self.num_steps,
            "first_step": self.first,
            "last_step": self.last,
            "clock": (
                "synthetic: the trace has no step times, 1 ms per step"
                if self.synthetic
                else "recorded step times (time_ns)"
            ),
            "time_unit": "ts and dur in whole microseconds; exact ns in args",
        }
        if self.clamped:
            data["clamped_steps"] = self.clamped
        if self.late_timings:
            data["late_timings_dropped"] = self.late_timings
        if reader.cut is not None:
            data["cut"] = f"at byte {reader.cut.offset}: {reader.cut.reason}"
        elif not reader.finished:
            data["cut"] = "no END record: the writer had not closed the trace"
        return data

    def _emit(self, event: Event) -> None:
        self.w.write(event)


def _mid(start_ns: int, end_ns: int) -> int:
    a, b = us(start_ns), us(end_ns)
    return a + (b - a) // 2


def _kernels(t: Timing) -> dict[str, Any]:
    return {k.name: {"calls": k.calls, "total_ns": k.total_ns} for k in t.kernels}


def _enum_name(cls: type[enum.IntEnum], value: int) -> str:
    try:
        return cls(value).name
    except ValueError:  # a newer minor version's value
        return str(value)
