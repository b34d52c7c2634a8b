"""One pass over a trace for what-if in time: each step's work and duration, each
request's life in steps, and the latency metrics once the steps are given times.

The same `Observer` reads a recorded trace and the records of a predicted run as they are
made, so both sides of `schedtop whatif`'s table come from one definition of each metric.
Times are integer nanoseconds on the trace's clock (the recording's start is 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.records import percentile
from recorder.reader import TraceReader
from recorder.schema import Scheduled, Snapshot, Status, Step
from replays.costmodel import CostModel, fit_model, step_work
from replays.reducer import StepView, apply_with_view
from replays.state import State


@dataclass
class RequestLife:
    """One request, in steps."""

    arrival_step: int  # the step it was added before
    arrival_time: float  # the engine's arrival clock (seconds; its origin is arbitrary)
    first_scheduled_step: int = -1  # first step that scheduled it (-1: never)
    num_samples: int = 0  # tokens it sampled
    sample_steps: list[int] = field(default_factory=list)  # steps that sampled for it, ascending
    finish_step: int = -1  # -1: unfinished when the trace ended
    abort_step: int = -1  # the step whose record reports its abort (-1: none)


class Observer:
    """Collects what the metrics and the cost model need from step records in order."""

    def __init__(self, usable_blocks: int) -> None:
        self.usable = usable_blocks
        self.work: list[tuple[int, int, int, int, int]] = []  # FEATURES per step
        self.end_ns: list[int] = []  # the record's time_ns per step
        self.busy_ns: list[int] = []  # schedule + update + runner time per step
        self.idle_before: list[bool] = []  # nothing unfinished before the step
        self.steps: list[int] = []  # step index per observed record
        self.reqs: dict[int, RequestLife] = {}  # by ref
        self.timed = False  # some step carries runner timings
        self.preemptions = 0
        self.recompute_tokens = 0  # computed tokens thrown away by preemption
        self.min_free = usable_blocks
        self._unscheduled: dict[int, RequestLife] = {}  # arrived, not yet scheduled

    def observe(self, rec: Step, view: StepView, idle: bool) -> None:
        """A trace's record, with the reducer's view of it (the implicit decodes spelled out)."""
        self._begin(rec, view.scheduled, rec.time_ns, idle, None)
        self._sampled(rec.step, ((x.ref, x.count) for x in view.samples))

    def observe_explicit(
        self,
        rec: Step,
        time_ns: int,
        idle: bool,
        work: tuple[int, int, int, int, int] | None = None,
    ) -> None:
        """The engine's own record of a step: every entry explicit, no reducer needed.
        `work`: the step's FEATURES when the caller has them already."""
        entries = rec.scheduled
        self._begin(rec, entries, time_ns, idle, work)
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
            self._sampled(rec.step, ((e.ref, c) for e, c in zip(entries, counts) if c))
        if rec.other_samples:
            self._sampled(rec.step, ((x.ref, x.count) for x in rec.other_samples))

    def _begin(
        self,
        rec: Step,
        scheduled: tuple[Scheduled, ...],
        time_ns: int,
        idle: bool,
        work: tuple[int, int, int, int, int] | None,
    ) -> None:
        """Everything of a step but its samples."""
        step = rec.step
        self.steps.append(step)
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
        self.idle_before.append(idle)
        self.timed = self.timed or bool(rec.timings)
        unscheduled = self._unscheduled
        for a in rec.arrivals:
            life = RequestLife(step, a.arrival_time)
            self.reqs[a.ref] = life
            unscheduled[a.ref] = life
        if unscheduled:
            for e in scheduled:
                r = unscheduled.pop(e.ref, None)
                if r is not None:
                    r.first_scheduled_step = step
        for f in rec.finishes:
            r = self.reqs.get(f.ref)
            if r is not None:
                r.finish_step = step
                if f.status == Status.FINISHED_ABORTED:
                    r.abort_step = step
        if rec.preemptions:
            self.preemptions += len(rec.preemptions)
            self.recompute_tokens += sum(p.tokens_lost for p in rec.preemptions)
        if rec.free_blocks < self.min_free:
            self.min_free = rec.free_blocks

    def _sampled(self, step: int, samples: Iterable[tuple[int, int]]) -> None:
        reqs = self.reqs
        for ref, count in samples:
            r = reqs.get(ref)
            if r is not None and count:
                r.num_samples += count
                if not r.sample_steps or r.sample_steps[-1] != step:
                    r.sample_steps.append(step)

    def fit_rows(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(work, seconds, excluded): each step whose duration the trace measures (the
        engine was busy right before it, so it began when the previous step ended)."""
        rows = [i for i in range(1, len(self.end_ns)) if not self.idle_before[i] and self.end_ns[i]]
        work = np.array([self.work[i] for i in rows], dtype=np.int64).reshape(-1, 5)
        secs = np.array([(self.end_ns[i] - self.end_ns[i - 1]) / 1e9 for i in rows])
        return work, secs, len(self.end_ns) - len(rows)


def observe_trace(
    path: str | Path, on_step: Callable[[Step, StepView], None] | None = None
) -> tuple[Observer, int]:
    """Observe every step of the trace at `path`; also its first step. `on_step` gets
    each step with the reducer's view of it (one pass serves another reader too)."""
    with TraceReader(path) as reader:
        header = reader.header
        obs = Observer(header.num_blocks - 1)
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
    work, secs, excluded = obs.fit_rows() if obs.timed else (np.zeros((0, 5)), np.zeros(0), 0)
    return fit_model(work, secs, str(path), excluded)


# -- the recorded run's clock ------------------------------------------------------------------


@dataclass
class Timebase:
    """When each recorded step ended and each request arrived and was aborted, in ns."""

    end_ns: list[int]  # per step
    arrival_ns: list[int]  # per ref, non-decreasing (requests arrive in ref order)
    abort_ns: dict[int, int]  # ref -> when its abort happened


def recorded_timebase(obs: Observer, model: CostModel) -> Timebase:
    """The recorded run on one clock. A timed trace keeps its own step end times, and its
    arrivals are placed on them (below). A simulated trace has no meaningful clock: its
    steps take what `model` predicts, and a request arriving before step s arrives when
    step s - 1 ends, so that replaying it under the same model lands it in step s again."""
    if obs.timed:
        ends = list(obs.end_ns)
    else:
        work = np.array(obs.work, dtype=np.int64).reshape(-1, 5)
        ends = [int(v) for v in np.cumsum(model.predict_many_ns(work))]
    first = obs.steps[0] if obs.steps else 0

    def end_before(step: int) -> int:
        i = step - first - 1
        return ends[i] if i >= 0 else 0

    refs = sorted(obs.reqs)
    if obs.timed:
        arrivals = _place_arrivals(obs, ends, refs, first)
    else:
        arrivals = [end_before(obs.reqs[r].arrival_step) for r in refs]
    for i in range(1, len(arrivals)):
        arrivals[i] = max(arrivals[i], arrivals[i - 1])
    aborts = {
        r: max(end_before(obs.reqs[r].abort_step), arrivals[i])
        for i, r in enumerate(refs)
        if obs.reqs[r].abort_step >= 0
    }
    return Timebase(ends, arrivals, aborts)


def _place_arrivals(obs: Observer, ends: list[int], refs: list[int], first: int) -> list[int]:
    """Arrival times of a timed trace on its step clock.

    The engine stamps arrivals on its own clock, whose origin the trace does not record;
    their differences are exact. Request i was added before step s_i, so it arrived by
    the time step s_i began: when step s_i - 1 ended if the engine was busy then, else
    (the engine waited for it) the step's end minus its measured busy time. The latest
    origin that puts every arrival at or before its step is the estimate."""
    if not refs:
        return []
    base = obs.reqs[refs[0]].arrival_time
    rel = [round((obs.reqs[r].arrival_time - base) * 1e9) for r in refs]
    bounds = []
    for r, a in zip(refs, rel):
        i = obs.reqs[r].arrival_step - first
        if i <= 0:
            start = ends[0] - obs.busy_ns[0] if ends else 0
        elif obs.idle_before[i]:
            start = ends[i] - obs.busy_ns[i]
        else:
            start = ends[i - 1]
        bounds.append(start - a)
    origin = max(0, min(bounds))
    return [origin + a for a in rel]


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


def timed_metrics(obs: Observer, end_ns: list[int], arrival_ns: list[int]) -> TimedMetrics:
    """The metrics of the observed steps with step `i` ending at `end_ns[i]` and request
    ref order `k` arriving at `arrival_ns[k]`."""
    first = obs.steps[0] if obs.steps else 0
    ends = np.array(end_ns, dtype=np.int64)

    ttft: list[float] = []
    tpot: list[float] = []
    queue: list[float] = []
    sampling: list[int] = []  # every request's sampling steps, one request after another
    cuts: list[int] = []  # where in `sampling` each request's steps begin
    tokens = finished = 0
    for k, ref in enumerate(sorted(obs.reqs)):
        r = obs.reqs[ref]
        arrival = arrival_ns[k]
        tokens += r.num_samples
        finished += r.finish_step >= 0
        if r.first_scheduled_step >= 0:
            s = r.first_scheduled_step
            began = end_ns[s - 1 - first] if s > first else 0
            queue.append(max(0, began - arrival) / 1e9)
        steps = r.sample_steps
        if not steps:
            continue
        t_first = end_ns[steps[0] - first]
        ttft.append((t_first - arrival) / 1e9)
        cuts.append(len(sampling))
        sampling += steps
        if r.finish_step >= 0 and r.num_samples > 1:
            tpot.append((end_ns[steps[-1] - first] - t_first) / 1e9 / (r.num_samples - 1))
    # Inter-token latency: between consecutive sampling steps of one request, for all
    # requests at once (the same divisions as one at a time).
    at = ends[np.array(sampling, dtype=np.int64) - first] if sampling else ends[:0]
    gaps = np.diff(at)
    keep = np.ones(len(gaps), dtype=bool)
    keep[np.array(cuts[1:], dtype=np.int64) - 1] = False
    itl = np.sort(gaps[keep] / 1e9)
    start = arrival_ns[0] if arrival_ns else 0
    duration = (end_ns[-1] - start) / 1e9 if end_ns else 0.0
    return TimedMetrics(
        num_steps=len(end_ns),
        duration_s=duration,
        num_requests=len(obs.reqs),
        num_finished=finished,
        output_tokens=tokens,
        throughput=tokens / duration if duration > 0 else 0.0,
        ttft_p50=percentile(ttft, 50),
        ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50),
        tpot_p99=percentile(tpot, 99),
        itl_p50=_sorted_percentile(itl, 50),
        itl_p99=_sorted_percentile(itl, 99),
        queue_p50=percentile(queue, 50),
        queue_p99=percentile(queue, 99),
        preemptions=obs.preemptions,
        recompute_tokens=obs.recompute_tokens,
        peak_blocks=obs.usable - obs.min_free,
    )


def _sorted_percentile(xs: np.ndarray, q: float) -> float | None:
    """`percentile` of an already sorted array: the same interpolation, in Python floats."""
    if not len(xs):
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    a, b = float(xs[lo]), float(xs[hi])
    return a + (b - a) * (pos - lo)


def recorded_metrics(path: str | Path, model: CostModel | None = None) -> TimedMetrics:
    """The metrics of a recording on its own clock (a simulated one: on `model`'s)."""
    obs, _ = observe_trace(path)
    if not obs.timed and model is None:
        raise ValueError(f"{path}: no step timings; a simulated trace needs a model")
    base = recorded_timebase(obs, model or CostModel(0.0))
    return timed_metrics(obs, base.end_ns, base.arrival_ns)
