"""One fold over Step records: each request's lifecycle, and the run's metrics from it.

Every figure a command prints about latency, throughput and prefix hits comes from here:
`run` and `sim` fold the engine's own records as they are made, `stats` and `whatif` fold
a trace's (with the reducer spelling out the implicit decodes). The definitions are in
docs/metrics.md, vLLM's where vLLM has the metric.

The fold keeps steps, not times: a request's life is the steps where things happened to
it. A `Clock` then gives each step its start and end and each request its arrival, in
seconds for a real run and in steps for a simulated one, so that one fold serves the
recorded clock, a predicted one (`whatif`) and the step count alike.

Pure Python over engine.records: the engine may use it, and so may every reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import repeat
from typing import Any, TypedDict, cast

from engine.records import (
    Arrival,
    RequestState,
    Scheduled,
    Status,
    Step,
    entry_refs,
    percentile,
)

SECONDS = "s"  # a real run's unit: its steps' end times
STEPS = "steps"  # a simulated run's: its clock says nothing about a model


@dataclass(slots=True)
class Lifecycle:
    """One request's life, in steps (a Clock turns them into times)."""

    ref: int  # the request's ref
    request_id: str  # the engine's request id
    arrival_step: int  # the step it was added before (-1: before the recording)
    arrival_time: float  # the engine's arrival clock (seconds; its origin is arbitrary)
    num_prompt_tokens: int  # prompt length
    first_scheduled_step: int = -1  # the first step that scheduled it (-1: never)
    num_samples: int = 0  # output tokens sampled
    sample_steps: list[int] = field(default_factory=list)  # steps that gave it tokens
    finish_step: int = -1  # the step whose record reports its finish (-1: unfinished)
    status: int = 0  # a finished Status (0: unfinished)
    abort_step: int = -1  # the step whose record reports its abort (-1: none)
    preemptions: int = 0  # times preempted
    hit_tokens: list[int] = field(default_factory=list)  # prefix hits at each admission
    queried_tokens: list[int] = field(default_factory=list)  # tokens held at each admission
    priority: int = 0  # its scheduling priority (lower runs first)
    tenant: str | None = None  # whose it is, where its arrival says (None: not recorded)
    # preemptions and recompute inside the observed steps: a group's share of the run's
    # totals (`preemptions` also counts those before the recording)
    preempted_here: int = 0
    recompute_tokens: int = 0

    @property
    def finished_ok(self) -> bool:
        """Finished, and not with an error (aborts count: they were served until then)."""
        return self.finish_step >= 0 and self.status != Status.FINISHED_ERROR


class Lifecycles:
    """The fold: feed it every step record in order, the scheduled entries spelled out."""

    def __init__(self) -> None:
        self.reqs: dict[int, Lifecycle] = {}  # by ref
        self.steps: list[int] = []  # each observed record's step index
        self.preemptions = 0  # over the run
        self.recompute_tokens = 0  # computed tokens thrown away by preemptions
        self._unscheduled: dict[int, Lifecycle] = {}  # arrived, not yet scheduled

    def adopt(self, r: RequestState) -> None:
        """A request already there when the recording (or its readable part) began."""
        life = Lifecycle(r.ref, r.request_id, r.arrival_step, r.arrival_time, r.num_prompt_tokens)
        life.priority = r.priority
        life.first_scheduled_step = r.first_scheduled_step
        life.num_samples = r.num_output_tokens
        if r.num_output_tokens:
            # its first token came before the recording: no TTFT, TPOT or ITL from here
            life.sample_steps.append(r.first_token_step)
        life.preemptions = r.num_preemptions
        if r.num_cached_tokens >= 0:
            life.hit_tokens.append(r.num_cached_tokens)
            life.queried_tokens.append(r.num_prompt_tokens)
        self.reqs[r.ref] = life
        if r.first_scheduled_step < 0 and r.num_computed_tokens == 0:
            self._unscheduled[r.ref] = life

    def step(
        self, rec: Step, scheduled: Sequence[Scheduled], samples: Iterable[tuple[int, int]]
    ) -> None:
        """A step: its record, every scheduled entry, and (ref, tokens) per sample."""
        self.begin(rec, scheduled)
        self.sampled(rec.step, samples)

    def step_explicit(self, rec: Step) -> None:
        """The engine's own record of a step: every entry explicit."""
        self.step(rec, rec.scheduled, explicit_samples(rec))

    def begin(self, rec: Step, scheduled: Sequence[Scheduled]) -> None:
        """Everything of a step but its samples, which come after its admissions."""
        step = rec.step
        self.steps.append(step)
        for a in rec.arrivals:
            self._arrive(a, step)
        unscheduled = self._unscheduled
        if unscheduled:
            for ref in entry_refs(scheduled):
                life = unscheduled.pop(ref, None)
                if life is not None:
                    life.first_scheduled_step = step
        reqs = self.reqs
        for adm in rec.admissions:
            life = reqs.get(adm.ref)
            if life is not None:
                # what the prefix-cache lookup covered: the prompt, and after a
                # preemption the outputs too (vLLM's request.num_tokens)
                life.hit_tokens.append(adm.cached_tokens)
                life.queried_tokens.append(life.num_prompt_tokens + life.num_samples)
        for p in rec.preemptions:
            self.preemptions += 1
            self.recompute_tokens += p.tokens_lost
            life = reqs.get(p.victim)
            if life is not None:
                life.preemptions += 1
                life.preempted_here += 1
                life.recompute_tokens += p.tokens_lost
        for f in rec.finishes:
            life = reqs.get(f.ref)
            if life is not None:
                life.finish_step, life.status = step, f.status
                if f.status == Status.FINISHED_ABORTED:
                    life.abort_step = step

    def _arrive(self, a: Arrival, step: int) -> None:
        life = Lifecycle(a.ref, a.request_id, step, a.arrival_time, a.num_prompt_tokens)
        life.priority = a.priority
        life.tenant = a.tenant
        self.reqs[a.ref] = life
        self._unscheduled[a.ref] = life

    def sampled(self, step: int, samples: Iterable[tuple[int, int]]) -> None:
        reqs = self.reqs
        for ref, count in samples:
            life = reqs.get(ref)
            if life is not None and count:
                life.num_samples += count
                if not life.sample_steps or life.sample_steps[-1] != step:
                    life.sample_steps.append(step)


def explicit_samples(rec: Step) -> Iterable[tuple[int, int]]:
    """(ref, tokens) of every sample of an explicit record (the engine's): one per
    scheduled entry unless `sample_counts` says otherwise, then `other_samples`."""
    counts = rec.sample_counts
    refs = entry_refs(rec.scheduled)  # the engine's Entries: no record built per entry
    if counts is None:
        yield from zip(refs, repeat(1))
    else:
        yield from ((ref, c) for ref, c in zip(refs, counts) if c)
    yield from ((s.ref, s.count) for s in rec.other_samples)


# -- clocks ----------------------------------------------------------------------------------


@dataclass
class Clock:
    """When each observed step began and ended, and when each request arrived."""

    unit: str  # SECONDS or STEPS
    first_step: int  # the step of ends[0]
    ends: Sequence[float]  # per observed step: its end
    starts: Sequence[float]  # per observed step: when its work began (after any idle)
    arrivals: dict[int, float]  # per ref: when it arrived

    def end(self, step: int) -> float:
        return self.ends[step - self.first_step]

    def start(self, step: int) -> float:
        return self.starts[step - self.first_step]


def step_clock(fold: Lifecycles) -> Clock:
    """The clock of a simulated run: step s ends at s and starts at s - 1, and a request
    added before step s arrived when step s - 1 ended, so that a request sampled in the
    step it arrived before has a TTFT of 1 step."""
    first = fold.steps[0] if fold.steps else 0
    ends = [float(s) for s in fold.steps]
    starts = [e - 1.0 for e in ends]
    arrivals = {ref: float(r.arrival_step - 1) for ref, r in fold.reqs.items()}
    return Clock(STEPS, first, ends, starts, arrivals)


def place_arrivals(
    fold: Lifecycles, starts: Sequence[float], first_step: int, origin: float | None = None
) -> dict[int, float]:
    """Arrival times on a recording's step clock, from the engine's arrival clock.

    `origin`: the arrival clock's reading at the recording's time 0 (Header's
    arrival_origin_ns, format 1.4), which places them exactly. Older traces do not record
    it; their arrivals' differences are exact, and a request added before step s arrived
    by the time step s began: the latest origin that puts every arrival at or before its
    step's start is the estimate (late by the time from the first request's arrival to the
    first step, its tokenization, a few ms)."""
    if origin is not None:
        return {ref: r.arrival_time - origin for ref, r in fold.reqs.items()}
    lives = [r for r in fold.reqs.values() if r.arrival_step >= first_step]
    if not lives:
        return {ref: 0.0 for ref in fold.reqs}
    slack = min(starts[r.arrival_step - first_step] - r.arrival_time for r in lives)
    base = min(r.arrival_time for r in lives)
    origin = max(slack, -base)  # no arrival before the recording's time 0
    return {ref: max(0.0, r.arrival_time + origin) for ref, r in fold.reqs.items()}


def step_starts(
    ends: Sequence[float], work: Sequence[float | None], busy: Sequence[float], idle: Sequence[bool]
) -> list[float]:
    """Each step's start: its end minus its work where the record has it (format 1.4).
    An older record (work None) starts when the step before it ended, unless it is the
    first or the engine was idle before it (nothing unfinished): then its end minus its
    measured parts (`busy`: schedule, runner, update), so that the wait before it is not
    taken for work (docs/metrics.md)."""
    out: list[float] = []
    for i, end in enumerate(ends):
        w = work[i]
        if w is not None:
            out.append(end - w)
        elif i and not idle[i]:
            out.append(ends[i - 1])
        else:
            out.append(end - busy[i])
    return out


# -- metrics ---------------------------------------------------------------------------------


@dataclass
class RequestTimes:
    """One request's latencies on a clock (None: it never got that far)."""

    ttft: float | None  # arrival -> end of the step that sampled its first token
    tpot: float | None  # (last token - first token) / (output tokens - 1), finished only
    e2e: float | None  # arrival -> end of the step that finished it (errors aside)
    queue: float | None  # arrival -> start of the first step that scheduled it
    itl: list[float]  # between consecutive steps that gave it tokens
    prefill: float | None = None  # start of the first step that scheduled it -> first token
    decode: float | None = None  # first token -> last token (finished only)


def request_times(r: Lifecycle, clock: Clock) -> RequestTimes:
    arrival = clock.arrivals.get(r.ref, 0.0)
    steps = r.sample_steps
    ttft = tpot = e2e = queue = prefill = decode = None
    itl: list[float] = []
    scheduled = r.first_scheduled_step >= clock.first_step
    if scheduled:
        queue = max(0.0, clock.start(r.first_scheduled_step) - arrival)
    if steps and steps[0] >= clock.first_step:
        times = [clock.end(s) for s in steps]
        ttft = times[0] - arrival
        itl = [b - a for a, b in zip(times, times[1:])]
        if scheduled:
            prefill = times[0] - clock.start(r.first_scheduled_step)
        if r.finished_ok:
            decode = times[-1] - times[0]
            if r.num_samples > 1:
                tpot = decode / (r.num_samples - 1)
    if r.finished_ok and r.arrival_step >= clock.first_step:
        e2e = clock.end(r.finish_step) - arrival
    return RequestTimes(ttft, tpot, e2e, queue, itl, prefill, decode)


class Latencies(TypedDict):
    """The p50 and p99 of the five latencies, under the names every record that reports
    them gives them (RunMetrics, ClientMetrics, a trace's TraceStats and ServerStats):
    one list to build and copy them by, so that no record drops one on the way."""

    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    queue_p50: float | None
    queue_p99: float | None


def latencies(
    ttft: list[float], tpot: list[float], itl: list[float], e2e: list[float], queue: list[float]
) -> Latencies:
    """The percentiles of each latency's samples."""
    samples = {"ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "queue": queue}
    return cast(
        Latencies,
        {f"{name}_p{q}": percentile(xs, q) for name, xs in samples.items() for q in (50, 99)},
    )


def latencies_of(m: RunMetrics | ClientMetrics) -> Latencies:
    """The percentiles `m` holds, to be handed on as they are."""
    return cast(Latencies, {name: getattr(m, name) for name in Latencies.__annotations__})


@dataclass
class RunMetrics:
    """A run's figures, engine side (docs/metrics.md), in `unit` (seconds or steps)."""

    unit: str  # "s" (a real run) or "steps" (a simulated one)
    num_steps: int  # step records
    num_requests: int  # arrivals
    num_finished: int  # finished (any reason)
    num_errors: int  # finished with FINISHED_ERROR
    num_aborted: int  # finished with FINISHED_ABORTED
    prompt_tokens: int  # prompts of the requests that were scheduled
    output_tokens: int  # tokens sampled
    duration: float  # from the first arrival to the last step's end
    throughput: float  # output tokens per unit
    ttft_p50: float | None  # time to first token (vllm:time_to_first_token_seconds)
    ttft_p99: float | None
    tpot_p50: float | None  # time per output token (vllm:request_time_per_output_token)
    tpot_p99: float | None
    itl_p50: float | None  # inter-token latency (vllm:inter_token_latency_seconds)
    itl_p99: float | None
    e2e_p50: float | None  # end to end (vllm:e2e_request_latency_seconds)
    e2e_p99: float | None
    queue_p50: float | None  # arrival to first scheduled (vllm:request_queue_time_seconds)
    queue_p99: float | None
    preemptions: int  # preemptions
    recompute_tokens: int  # computed tokens thrown away by preemptions
    prefix_hit_tokens: int  # prefix-cache hits at first admissions (vllm:prefix_cache_hits)
    prefix_query_tokens: int  # tokens looked up then (vllm:prefix_cache_queries)
    readmit_hit_tokens: int  # hits at re-admissions after a preemption
    readmit_query_tokens: int  # tokens looked up then

    @property
    def prefix_hit_rate(self) -> float:
        """vLLM's prefix-cache hit rate: first admissions' hits over their lookups."""
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["prefix_hit_rate"] = self.prefix_hit_rate
        return out


def run_metrics(fold: Lifecycles, clock: Clock, last_end: float | None = None) -> RunMetrics:
    """The run's figures: the fold's lives on `clock`. `last_end`: the run's end when it is
    not the last observed step's (default)."""
    lives = [fold.reqs[ref] for ref in sorted(fold.reqs)]
    times = [request_times(r, clock) for r in lives]
    ttft = [t.ttft for t in times if t.ttft is not None]
    tpot = [t.tpot for t in times if t.tpot is not None]
    e2e = [t.e2e for t in times if t.e2e is not None]
    queue = [t.queue for t in times if t.queue is not None]
    itl = [g for t in times for g in t.itl]
    first = (
        [r.hit_tokens[0] for r in lives if r.hit_tokens],
        [r.queried_tokens[0] for r in lives if r.queried_tokens],
    )
    again = (
        [h for r in lives for h in r.hit_tokens[1:]],
        [q for r in lives for q in r.queried_tokens[1:]],
    )
    out_tokens = sum(r.num_samples for r in lives)
    end = last_end if last_end is not None else (clock.ends[-1] if clock.ends else 0.0)
    start = min(clock.arrivals.values(), default=end)
    if clock.unit == SECONDS and clock.starts:
        start = min(start, clock.starts[0])  # a trace that began mid-run
    duration = max(0.0, end - start)
    return RunMetrics(
        unit=clock.unit,
        num_steps=len(fold.steps),
        num_requests=len(lives),
        num_finished=sum(1 for r in lives if r.finish_step >= 0),
        num_errors=sum(1 for r in lives if r.status == Status.FINISHED_ERROR),
        num_aborted=sum(1 for r in lives if r.status == Status.FINISHED_ABORTED),
        prompt_tokens=sum(r.num_prompt_tokens for r in lives if r.first_scheduled_step >= 0),
        output_tokens=out_tokens,
        duration=duration,
        throughput=out_tokens / duration if duration > 0 else 0.0,
        **latencies(ttft, tpot, itl, e2e, queue),
        preemptions=fold.preemptions,
        recompute_tokens=fold.recompute_tokens,
        prefix_hit_tokens=sum(first[0]),
        prefix_query_tokens=sum(first[1]),
        readmit_hit_tokens=sum(again[0]),
        readmit_query_tokens=sum(again[1]),
    )


# -- the client side: what a server's clients saw (vllm bench serve's definitions) ----------


@dataclass
class ClientRequest:
    """One response as its client saw it (a server's CLIENT record), seconds from when
    its HTTP request arrived."""

    queue: float | None  # -> first scheduled (None: never scheduled)
    ttft: float | None  # -> first token chunk sent (None: none sent)
    itl: Sequence[float]  # gaps between consecutive token chunks sent
    e2e: float | None  # -> the response's end, for one that completed (None: it did not)
    output_tokens: int  # tokens generated


@dataclass
class ClientMetrics:
    """The client side's percentiles, as `vllm bench serve` reports them (docs/metrics.md)."""

    queue_p50: float | None
    queue_p99: float | None
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None  # (e2e - TTFT) / (output tokens - 1): completed, >= 2 tokens
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None


def client_metrics(reqs: Iterable[ClientRequest]) -> ClientMetrics:
    queue: list[float] = []
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    for r in reqs:
        if r.queue is not None:
            queue.append(r.queue)
        if r.ttft is not None:
            ttft.append(r.ttft)
        itl.extend(r.itl)
        if r.e2e is not None:
            e2e.append(r.e2e)
            # vllm bench serve's TPOT: the time after the first token over the tokens after it
            if r.ttft is not None and r.output_tokens > 1:
                tpot.append((r.e2e - r.ttft) / (r.output_tokens - 1))
    return ClientMetrics(**latencies(ttft, tpot, itl, e2e, queue))


@dataclass
class GroupMetrics:
    """One group's share of a run (`--group-by`): run_metrics over its requests alone, on
    the run's clock and span, so that its counts and tokens sum over the groups to the
    run's, and so do its throughput and its summed queue time."""

    key: str  # the group's name (a priority, a tenant, a regex's match)
    metrics: RunMetrics
    queue_total: float  # every request's queue time, summed (the wait it cost)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.key, **self.metrics.to_json(), "queue_total": self.queue_total}


def group_metrics(
    fold: Lifecycles,
    clock: Clock,
    key: Callable[[Lifecycle], str],
    last_end: float | None = None,
) -> list[GroupMetrics]:
    """run_metrics per group of requests (`key` names each request's group), in the
    order the groups first arrive. Each group is a fold of its own lives over the same
    steps: the definitions stay run_metrics' own."""
    subs: dict[str, Lifecycles] = {}
    for ref in sorted(fold.reqs):
        life = fold.reqs[ref]
        k = key(life)
        sub = subs.get(k)
        if sub is None:
            sub = subs[k] = Lifecycles()
            sub.steps = fold.steps
        sub.reqs[ref] = life
        sub.preemptions += life.preempted_here
        sub.recompute_tokens += life.recompute_tokens
    end = last_end if last_end is not None else (clock.ends[-1] if clock.ends else 0.0)
    return [
        GroupMetrics(k, run_metrics(sub, clock, end), queue_total(sub, clock))
        for k, sub in subs.items()
    ]


def queue_total(fold: Lifecycles, clock: Clock) -> float:
    """The queue times of the fold's requests, summed (those never scheduled add none)."""
    total = 0.0
    for life in fold.reqs.values():
        q = request_times(life, clock).queue
        if q is not None:
            total += q
    return total


# -- the engine's side: a sink that folds a run as it happens ----------------------------------


class MetricsSink:
    """An EventSink that folds every step of a real run on the engine's clock (seconds),
    then passes it on: `run`'s summary, from the same fold as a trace's `stats`."""

    def __init__(self, clock: Callable[[], float], downstream: Any = None) -> None:
        self.clock = clock  # the engine's: the one its arrivals are stamped with
        self.downstream = downstream  # the sink it replaced (None: none)
        self.fold = Lifecycles()
        self.ends: list[float] = []  # per step
        self.starts: list[float] = []  # per step: its end minus its work

    def on_step(self, report: Step) -> None:
        end = self.clock()
        self.fold.step_explicit(report)
        self.ends.append(end)
        self.starts.append(end - report.work_ns / 1e9)
        if self.downstream is not None:
            self.downstream.on_step(report)

    def on_client(self, report: Any) -> None:
        on_client = getattr(self.downstream, "on_client", None)
        if on_client is not None:
            on_client(report)

    def close(self) -> None:
        if self.downstream is not None:
            self.downstream.close()

    def run_clock(self) -> Clock:
        """The run's clock: the engine's, arrivals as the engine stamped them."""
        fold = self.fold
        first = fold.steps[0] if fold.steps else 0
        arrivals = {ref: r.arrival_time for ref, r in fold.reqs.items()}
        return Clock(SECONDS, first, self.ends, self.starts, arrivals)

    def metrics(self) -> RunMetrics:
        return run_metrics(self.fold, self.run_clock())

    def request_times(self) -> dict[str, RequestTimes]:
        """Each request's latencies, by request id (the last request of a reused id)."""
        clock = self.run_clock()
        lives = (self.fold.reqs[ref] for ref in sorted(self.fold.reqs))
        return {r.request_id: request_times(r, clock) for r in lives}


# -- a server's side: the fold of a run that never ends, one step at a time -----------------


@dataclass
class StepObservations:
    """What one step adds to a live run's metrics, as vLLM's Prometheus metrics observe
    them (the server's /metrics): the same definitions as `run_metrics`, per event."""

    ttft: list[float] = field(default_factory=list)  # requests that got their first token
    itl: list[float] = field(default_factory=list)  # gaps ending at this step
    finished: list[tuple[Lifecycle, RequestTimes]] = field(default_factory=list)  # errors too
    prompt_tokens: int = 0  # prompts of the requests that got their first token
    generation_tokens: int = 0  # tokens sampled
    prefix_hit_tokens: int = 0  # prefix-cache hits at first admissions
    prefix_query_tokens: int = 0  # tokens looked up then
    preemptions: int = 0


class LiveMetrics:
    """The fold of a server's engine (which runs for days): each step's record in,
    what it adds to the metrics out, and a finished request's life forgotten once
    observed, so that memory follows the requests in flight, not the steps or requests
    served. Times are on the engine's clock, which stamps arrivals."""

    def __init__(self) -> None:
        self.fold = Lifecycles()
        self.first_step = 0  # the step of ends[0]
        self.ends: list[float] = []  # per step from first_step on
        self.starts: list[float] = []
        self.arrivals: dict[int, float] = {}  # per ref in flight: its arrival_time

    def step(self, rec: Step, end: float) -> StepObservations:
        """The step's record, and when its work ended (the record's making: where a
        recorder stamps it), so that the figures are the trace's own."""
        fold = self.fold
        if not self.ends:
            self.first_step = rec.step
        before = fold.preemptions
        fold.step_explicit(rec)
        for a in rec.arrivals:
            self.arrivals[a.ref] = a.arrival_time
        self.ends.append(end)
        self.starts.append(end - rec.work_ns / 1e9)
        obs = StepObservations(preemptions=fold.preemptions - before)
        reqs = fold.reqs
        for adm in rec.admissions:
            life = reqs.get(adm.ref)
            if life is not None and len(life.hit_tokens) == 1:  # its first admission
                obs.prefix_hit_tokens += life.hit_tokens[0]
                obs.prefix_query_tokens += life.queried_tokens[0]
        clock = self._clock()
        step = rec.step
        seen: set[int] = set()  # a request sampled twice in a step has one gap, not two
        for ref, count in explicit_samples(rec):
            life = reqs.get(ref)
            if life is None or not count:
                continue
            obs.generation_tokens += count
            steps = life.sample_steps
            if steps[-1] != step or ref in seen:
                continue
            seen.add(ref)
            if len(steps) == 1:
                obs.ttft.append(end - clock.arrivals[ref])
                obs.prompt_tokens += life.num_prompt_tokens
            elif steps[-2] >= self.first_step:
                obs.itl.append(end - clock.end(steps[-2]))
        for f in rec.finishes:
            life = reqs.pop(f.ref, None)
            if life is not None:
                obs.finished.append((life, request_times(life, clock)))
                fold._unscheduled.pop(f.ref, None)
                self.arrivals.pop(f.ref, None)
        self._trim()
        return obs

    def _clock(self) -> Clock:
        # the arrivals kept as they come and go: no pass over the requests in flight
        return Clock(SECONDS, self.first_step, self.ends, self.starts, self.arrivals)

    def _trim(self) -> None:
        """Forget the times of steps before every request in flight arrived."""
        last = self.first_step + len(self.ends) - 1
        # requests are kept in arrival order (a dict keeps it through deletions): the
        # first in flight arrived first
        oldest = next(iter(self.fold.reqs.values()), None)
        keep = last if oldest is None else oldest.arrival_step
        cut = max(0, min(keep, last) - self.first_step)
        if cut >= 64 or (cut and not self.fold.reqs):  # amortized: not on every step
            del self.ends[:cut], self.starts[:cut]
            self.first_step += cut
        del self.fold.steps[:-1]  # the step list is the batch fold's; one is enough here
