"""One pass over a trace for what-if in time: each step's work and duration, each
request's life in steps, and the latency metrics once the steps are given times.

The same `Observer` reads a recorded trace and the records of a predicted run as they are
made, so both sides of `schedtop whatif`'s table come from one definition of each metric.
Times are integer nanoseconds on the trace's clock (the recording's start is 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.metrics import SECONDS, Clock, Lifecycles, place_arrivals, run_metrics, step_starts
from recorder.reader import TraceReader
from recorder.schema import Scheduled, Snapshot, Step
from replays.costmodel import CostModel, CostModelError, fit_model, step_work
from replays.reducer import StepView, apply_with_view
from replays.state import State


class Observer(Lifecycles):
    """The request lifecycles (the one fold, engine.metrics) plus what the cost model
    needs: each step's work, end, measured parts and whether the engine was idle before."""

    def __init__(self, usable_blocks: int) -> None:
        super().__init__()
        self.usable = usable_blocks
        self.work: list[tuple[int, int, int, int, int]] = []  # FEATURES per step
        self.end_ns: list[int] = []  # the record's time_ns per step
        self.busy_ns: list[int] = []  # schedule + update + runner time per step
        self.work_ns: list[int | None] = []  # the record's work_ns (None: not recorded)
        self.idle_before: list[bool] = []  # nothing unfinished before the step
        self.timed = False  # some step carries runner timings, or model-step work_ns
        # Whether a step's work_ns is the model's step (recorded inside vLLM, format 1.4)
        # and so times the trace without runner timings; a simulation's is only its
        # bookkeeping, no model time.
        self.work_is_model_time = False
        self.min_free = usable_blocks
        self.arrival_origin_ns: int | None = None  # the trace header's (format 1.4)

    def observe(self, rec: Step, view: StepView, idle: bool) -> None:
        """A trace's record, with the reducer's view of it (the implicit decodes spelled out)."""
        self._step(rec, view.scheduled, rec.time_ns, idle, None, rec.work_ns or None)
        self.sampled(rec.step, ((x.ref, x.count) for x in view.samples))

    def observe_explicit(
        self,
        rec: Step,
        time_ns: int,
        idle: bool,
        work: tuple[int, int, int, int, int] | None = None,
    ) -> None:
        """The engine's own record of a step (a predicted run's): every entry explicit, no
        reducer needed. `work`: the step's FEATURES when the caller has them already."""
        entries = rec.scheduled
        self._step(rec, entries, time_ns, idle, work, None)
        counts = rec.sample_counts
        if counts is None:  # one token each: the common case, kept out of the general path
            step, reqs = rec.step, self.reqs
            for e in entries:
                r = reqs.get(e.ref)
                if r is not None:
                    r.num_samples += 1
                    if not r.sample_steps or r.sample_steps[-1] != step:
                        r.sample_steps.append(step)
        else:
            self.sampled(rec.step, ((e.ref, c) for e, c in zip(entries, counts) if c))
        if rec.other_samples:
            self.sampled(rec.step, ((x.ref, x.count) for x in rec.other_samples))

    def _step(
        self,
        rec: Step,
        scheduled: Sequence[Scheduled],
        time_ns: int,
        idle: bool,
        work: tuple[int, int, int, int, int] | None,
        work_ns: int | None,
    ) -> None:
        """Everything of a step but its samples."""
        self.begin(rec, scheduled)
        if work is None:
            work = step_work(
                (e.num_tokens, e.num_spec_tokens, e.num_computed_before) for e in scheduled
            )
        self.work.append(work)
        self.end_ns.append(time_ns)
        busy = rec.schedule_ns + rec.update_ns
        for t in rec.timings:
            busy += t.prepare_ns + t.forward_ns + t.sample_ns
        self.busy_ns.append(busy)
        self.work_ns.append(work_ns)
        self.idle_before.append(idle)
        self.timed = (
            self.timed or bool(rec.timings) or (self.work_is_model_time and work_ns is not None)
        )
        if rec.free_blocks < self.min_free:
            self.min_free = rec.free_blocks

    def starts_ns(self, end_ns: list[int]) -> list[int]:
        """Each step's start with step i ending at end_ns[i] (engine.metrics.step_starts)."""
        ends = [e / 1e9 for e in end_ns]
        work = [None if w is None else w / 1e9 for w in self.work_ns]
        busy = [b / 1e9 for b in self.busy_ns]
        return [round(t * 1e9) for t in step_starts(ends, work, busy, self.idle_before)]

    def fit_rows(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(work, seconds, excluded): each step whose duration the trace measures. A step
        the engine ran straight after another took from that one's end to its own (its
        whole cost, the host's bookkeeping between steps included); a step after idle
        time took its recorded work (format 1.4), never the wait; an older trace's step
        after idle time has no measurable start and is left out."""
        rows: list[int] = []
        secs: list[float] = []
        for i in range(len(self.end_ns)):
            if not self.end_ns[i]:
                continue
            if i and not self.idle_before[i]:
                rows.append(i)
                secs.append((self.end_ns[i] - self.end_ns[i - 1]) / 1e9)
            elif (w := self.work_ns[i]) is not None:
                rows.append(i)
                secs.append(w / 1e9)
        work = np.array([self.work[i] for i in rows], dtype=np.int64).reshape(-1, 5)
        return work, np.array(secs), len(self.end_ns) - len(rows)

    def fit(self, source: str) -> CostModel:
        """The step-time model fitted on these steps (fit_rows). When the recording began
        with the engine and its first step's work is measured (format 1.4), that step is
        the engine's first, with its one-time costs: the model's warm-up."""
        work, secs, excluded = self.fit_rows()
        warmup = bool(
            self.steps and self.steps[0] == 0 and self.end_ns[0] and self.work_ns[0] is not None
        )
        if warmup and self.arrival_origin_ns is not None:
            # The engine's first step is measured from the arrival that woke it: before
            # its work began, the engine took that request in (the tokenizer's first call,
            # hundreds of ms on a CPU), and a predicted run starts its first step at that
            # arrival. Arrivals are exact on the trace's clock here (format 1.4).
            woke = [r.arrival_time for r in self.reqs.values() if r.arrival_step == 0]
            if woke:
                since = self.end_ns[0] / 1e9 - (min(woke) - self.arrival_origin_ns / 1e9)
                secs[0] = max(float(secs[0]), since)
        return fit_model(work, secs, source, excluded, warmup)


def observe_trace(
    path: str | Path, on_step: Callable[[Step, StepView], None] | None = None
) -> tuple[Observer, int]:
    """Observe every step of the trace at `path`; also its first step. `on_step` gets
    each step with the reducer's view of it (one pass serves another reader too)."""
    with TraceReader(path) as reader:
        header = reader.header
        obs = Observer(header.num_blocks - 1)
        obs.arrival_origin_ns = header.arrival_origin_ns
        obs.work_is_model_time = header.engine.startswith("vLLM")
        state: State | None = None
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Snapshot):
                if state is None:
                    state = State.from_snapshot(header, rec)
                continue
            if not isinstance(rec, Step):
                continue
            if state is None:
                state = State.initial(header)
            idle = not state.requests
            view = apply_with_view(state, rec, entry.offset)
            obs.observe(rec, view, idle)
            if on_step is not None:
                on_step(rec, view)
        return obs, header.first_step


def fit_trace(path: str | Path) -> CostModel:
    """The cost model fitted on a trace's own step timings."""
    obs, _ = observe_trace(path)
    if not obs.timed:
        raise CostModelError(f"{path}: {why_untimed(path)}: there are no step times to fit")
    return obs.fit(str(path))


def why_untimed(path: str | Path) -> str:
    """Why the trace at `path` has no step timings, in words, from what wrote it."""
    with TraceReader(path) as reader:
        engine = reader.header.engine
    if "(SimRunner)" in engine:
        return "no step timings: a simulated run (schedtop sim), whose steps take no model time"
    if engine.startswith("vLLM"):
        return (
            f"no step timings: recorded by schedtop's plugin in {engine}, "
            "before it recorded step times (trace format 1.4)"
        )
    return f"no step timings: its steps carry no runner timings (written by {engine})"


# -- the recorded run's clock ------------------------------------------------------------------


@dataclass
class Timebase:
    """When each recorded step began and ended and each request arrived and was aborted,
    in ns."""

    end_ns: list[int]  # per step
    arrival_ns: list[int]  # per ref, non-decreasing (requests arrive in ref order)
    abort_ns: dict[int, int]  # ref -> when its abort happened
    start_ns: list[int]  # per step: when its work began


def recorded_timebase(obs: Observer, model: CostModel) -> Timebase:
    """The recorded run on one clock. A timed trace keeps its own step end times, and its
    arrivals are placed on them (engine.metrics.place_arrivals). A simulated trace has no
    meaningful clock: its steps take what `model` predicts, and a request arriving before
    step s arrives when step s - 1 ends, so that replaying it under the same model lands
    it in step s again."""
    first = obs.steps[0] if obs.steps else 0
    refs = sorted(obs.reqs)
    if obs.timed:
        ends = list(obs.end_ns)
        starts = obs.starts_ns(ends)
        origin = None if obs.arrival_origin_ns is None else obs.arrival_origin_ns / 1e9
        placed = place_arrivals(obs, [t / 1e9 for t in starts], first, origin)
        arrivals = [round(placed[r] * 1e9) for r in refs]
    else:
        work = np.array(obs.work, dtype=np.int64).reshape(-1, 5)
        took = [int(v) for v in model.predict_many_ns(work)]
        busy = next((i for i, w in enumerate(obs.work) if w[4]), None)
        if busy is not None and first == 0:  # the engine's first model step warms it up,
            took[busy] = model.predict_ns(obs.work[busy], first=True)  # as a predicted run's
        ends = [int(v) for v in np.cumsum(took)] if took else []
        starts = [e - t for e, t in zip(ends, took)]
        arrivals = [_end_before(ends, first, obs.reqs[r].arrival_step) for r in refs]
    for i in range(1, len(arrivals)):
        arrivals[i] = max(arrivals[i], arrivals[i - 1])
    aborts = {
        r: max(_end_before(ends, first, obs.reqs[r].abort_step), arrivals[i])
        for i, r in enumerate(refs)
        if obs.reqs[r].abort_step >= 0
    }
    return Timebase(ends, arrivals, aborts, starts)


def _end_before(ends: list[int], first: int, step: int) -> int:
    """When the step before `step` ended (0 for the first)."""
    i = step - first - 1
    return ends[i] if i >= 0 else 0


# -- metrics --------------------------------------------------------------------------------------


@dataclass
class TimedMetrics:
    """Latency and throughput of a run on a clock (seconds)."""

    num_steps: int  # steps
    duration_s: float  # first arrival to the last step's end
    num_requests: int  # arrivals
    num_finished: int  # finished (any reason)
    output_tokens: int  # sampled tokens
    throughput: float  # output tokens per second
    ttft_p50: float | None  # arrival to first token, median
    ttft_p99: float | None  # ... 99th percentile
    tpot_p50: float | None  # mean time per output token after the first, median over requests
    tpot_p99: float | None  # ... 99th percentile
    itl_p50: float | None  # time between consecutive token-producing steps, median
    itl_p99: float | None  # ... 99th percentile
    queue_p50: float | None  # arrival to the start of the first step that schedules it, median
    queue_p99: float | None  # ... 99th percentile
    preemptions: int  # preemptions
    recompute_tokens: int  # computed tokens thrown away by preemptions
    peak_blocks: int  # most KV blocks in use at the end of a step

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def timed_clock(
    obs: Observer, end_ns: list[int], arrival_ns: list[int], start_ns: list[int] | None = None
) -> Clock:
    """The clock of the observed steps with step `i` ending at `end_ns[i]` (and its work
    starting at `start_ns[i]`; default: Observer.starts_ns) and request ref order `k`
    arriving at `arrival_ns[k]`."""
    first = obs.steps[0] if obs.steps else 0
    starts = start_ns if start_ns is not None else obs.starts_ns(end_ns)
    arrivals = {ref: arrival_ns[k] / 1e9 for k, ref in enumerate(sorted(obs.reqs))}
    return Clock(SECONDS, first, [e / 1e9 for e in end_ns], [t / 1e9 for t in starts], arrivals)


def timed_metrics(
    obs: Observer, end_ns: list[int], arrival_ns: list[int], start_ns: list[int] | None = None
) -> TimedMetrics:
    """The metrics of the observed steps on timed_clock's clock:
    engine.metrics.run_metrics, the one definition."""
    clock = timed_clock(obs, end_ns, arrival_ns, start_ns)
    m = run_metrics(obs, clock)
    return TimedMetrics(
        num_steps=len(end_ns),
        duration_s=m.duration,
        num_requests=m.num_requests,
        num_finished=m.num_finished,
        output_tokens=m.output_tokens,
        throughput=m.throughput,
        ttft_p50=m.ttft_p50,
        ttft_p99=m.ttft_p99,
        tpot_p50=m.tpot_p50,
        tpot_p99=m.tpot_p99,
        itl_p50=m.itl_p50,
        itl_p99=m.itl_p99,
        queue_p50=m.queue_p50,
        queue_p99=m.queue_p99,
        preemptions=m.preemptions,
        recompute_tokens=m.recompute_tokens,
        peak_blocks=obs.usable - obs.min_free,
    )


def recorded_metrics(path: str | Path, model: CostModel | None = None) -> TimedMetrics:
    """The metrics of a recording on its own clock (a simulated one: on `model`'s)."""
    obs, _ = observe_trace(path)
    if not obs.timed and model is None:
        raise ValueError(f"{path}: {why_untimed(path)}; give a step-time model")
    base = recorded_timebase(obs, model or CostModel(0.0))
    return timed_metrics(obs, base.end_ns, base.arrival_ns, base.start_ns)
