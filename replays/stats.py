"""The metrics of one trace: throughput, TTFT and TPOT percentiles, preemptions, prefix
hits, KV pressure. One pass with the reducer; memory grows with requests, not steps.

A trace of the real engine (its steps carry the model runner's timings) is measured in
seconds, from the step records' end times; a simulated one in steps, since its clock says
nothing about a model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.metrics import (
    SECONDS,
    Clock,
    GroupMetrics,
    Lifecycle,
    Lifecycles,
    RunMetrics,
    group_metrics,
    latencies_of,
    place_arrivals,
    queue_total,
    request_times,
    run_metrics,
    step_clock,
    step_starts,
)
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.schema import (
    STATUS_LABELS,
    Client,
    Snapshot,
    Step,
    label,
    printable,
)
from replays.clients import ServerStats, format_server, server_stats
from replays.groups import GroupBy, format_groups
from replays.reducer import apply_with_view
from replays.state import State


@dataclass
class RequestStats:
    """One request's life, as the trace tells it (engine.metrics' lifecycle on the
    trace's clock)."""

    request_id: str  # the engine's id
    arrival_step: int  # step it arrived in
    first_token_step: int  # -1: it never sampled
    finish_step: int  # -1: it had not finished when the trace ended
    status: str  # how it finished ("" if it had not)
    prompt_tokens: int  # prompt length
    output_tokens: int  # tokens sampled
    preemptions: int  # times preempted
    cached_tokens: int  # prefix-hit tokens at its first admission (-1: never admitted)
    ttft: float | None  # arrival to first token (seconds, or steps when simulated)
    tpot: float | None  # per output token after the first (seconds, or steps)
    e2e: float | None = None  # arrival to finish (seconds, or steps)
    queue: float | None = None  # arrival to the start of the first step that scheduled it
    readmit_cached_tokens: int = 0  # prefix-hit tokens at its re-admissions


@dataclass
class TraceStats:
    """The metrics of one trace: engine-side figures from engine.metrics (definitions in
    docs/metrics.md), and the clients' when a server wrote the trace."""

    unit: str  # "s" for a timed (real-engine) trace, "steps" for a simulated one
    num_steps: int  # step records
    duration_s: float  # wall time: from the recording's start to the last step's end
    num_requests: int  # arrivals
    num_finished: int  # finished (any reason)
    num_errors: int  # finished with FINISHED_ERROR
    output_tokens: int  # over every request
    throughput: float  # output tokens per second (timed) or per step, first arrival to end
    ttft_p50: float | None  # time to first token, median
    ttft_p99: float | None  # ... 99th percentile
    tpot_p50: float | None  # time per output token after the first, median
    tpot_p99: float | None  # ... 99th percentile
    preemptions: int  # preemptions over the trace
    prefix_hit_rate: float  # first admissions' prefix-cache hits over their lookups (vLLM's)
    peak_blocks: int  # most KV blocks in use at the end of a step
    usable_blocks: int  # blocks in the pool, the null block aside
    mean_budget_use: float  # scheduled tokens / budget, averaged over steps
    requests: list[RequestStats] = field(default_factory=list)  # in arrival order
    spec_verifications: int = 0  # scheduled entries that verified drafts
    spec_drafts: int = 0  # drafts verified (scheduled), over the trace
    spec_accepted: int = 0  # drafts accepted
    num_aborted: int = 0  # finished with FINISHED_ABORTED (a client left, or a stop string)
    server: ServerStats | None = None  # the HTTP side, when a server wrote the trace
    itl_p50: float | None = None  # inter-token latency (between token-giving steps), median
    itl_p99: float | None = None  # ... 99th percentile
    e2e_p50: float | None = None  # arrival to finish, median
    e2e_p99: float | None = None  # ... 99th percentile
    queue_p50: float | None = None  # arrival to first scheduled, median
    queue_p99: float | None = None  # ... 99th percentile
    prefix_hit_tokens: int = 0  # first admissions' prefix-cache hits
    readmit_hit_tokens: int = 0  # hits at re-admissions after a preemption
    readmit_query_tokens: int = 0  # tokens looked up at those re-admissions
    work_s: float = 0.0  # the steps' work (timed traces with work_ns; else 0)
    idle_s: float = 0.0  # the waits before steps (timed traces with work_ns; else 0)
    # "tokens" (SGLang): peak_blocks and usable_blocks count the token pool's slots, from
    # the steps' free_slots (the trace's block map is not tracked; format 1.5)
    kv_pool: str = "blocks"
    # --group-by: each group's figures (None: not grouped), and the totals they sum to
    groups: list[GroupMetrics] | None = None
    group_by: GroupBy | None = field(default=None, repr=False)
    queue_total: float = 0.0  # every request's queue time, summed
    totals: RunMetrics | None = field(default=None, repr=False)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts; None without speculative decoding."""
        return self.spec_accepted / self.spec_drafts if self.spec_drafts else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verification emits on average: the accepted drafts plus the bonus
        token (vLLM's "mean acceptance length"); None without speculative decoding."""
        if not self.spec_verifications:
            return None
        return 1 + self.spec_accepted / self.spec_verifications

    def to_json(self) -> dict[str, Any]:
        groups, by, totals = self.groups, self.group_by, self.totals
        self.groups = self.group_by = self.totals = None  # asdict would spell them out
        try:
            out = asdict(self)
        finally:
            self.groups, self.group_by, self.totals = groups, by, totals
        for k in ("groups", "group_by", "totals"):
            out.pop(k)
        if groups is not None and by is not None:
            out["group_by"] = by.spec
            out["groups"] = [g.to_json() for g in groups]
        out["acceptance_rate"] = self.acceptance_rate
        out["mean_acceptance_length"] = self.mean_acceptance_length
        return out


def trace_stats(path: str | Path, group_by: GroupBy | None = None) -> TraceStats:
    """Compute the metrics of the trace at `path` (its readable part, if it was cut);
    with `group_by`, each group's too."""
    with open_trace(path) as reader:
        return _Collector(reader, group_by).run()


class _Collector:
    def __init__(self, reader: TraceReader, group_by: GroupBy | None = None) -> None:
        self.reader = reader
        self.group_by = group_by
        header = reader.header
        self.timed = False  # whether any step carries runner timings (or model-step work)
        # A vLLM trace's work_ns is the model's step (format 1.4, recorder.vllm), so it
        # times the trace; a simulation's is only its bookkeeping (replays.timebase too).
        self.work_is_model_time = header.engine.startswith("vLLM")
        self.usable = header.num_blocks - 1
        self.fold = Lifecycles()
        self.ends: list[float] = []  # each step's end, seconds since recording started
        self.work: list[float | None] = []  # each step's recorded work (None: not recorded)
        self.busy: list[float] = []  # each step's measured parts (schedule, runner, update)
        self.idle: list[bool] = []  # nothing unfinished before the step
        self.slots = header.kv_pool == "tokens"  # occupancy from free_slots (format 1.5)
        self.min_free = self.usable
        self.budget_use = 0.0
        self.spec = [0, 0, 0]  # verifications, drafts verified, drafts accepted
        self.clients: list[Client] = []

    def run(self) -> TraceStats:
        state: State | None = None
        for entry in self.reader.entries():
            rec = entry.record
            if not isinstance(rec, Step):
                if isinstance(rec, Client):
                    self.clients.append(rec)
                elif isinstance(rec, Snapshot) and state is None:
                    state = State.from_snapshot(self.reader.header, rec)
                    for r in state.requests.values():
                        self.fold.adopt(r)
                continue
            if state is None:
                state = State.initial(self.reader.header)
            self.idle.append(not state.requests)
            view = apply_with_view(state, rec, entry.offset)
            self.fold.step(rec, view.scheduled, ((x.ref, x.count) for x in view.samples))
            self._observe(rec)
        return self._summarise()

    def _observe(self, rec: Step) -> None:
        self.ends.append(rec.time_ns / 1e9)
        self.work.append(rec.work_ns / 1e9 if rec.work_ns else None)
        busy = rec.schedule_ns + rec.update_ns
        for t in rec.timings:
            busy += t.prepare_ns + t.forward_ns + t.sample_ns
        self.busy.append(busy / 1e9)
        self.timed = (
            self.timed or bool(rec.timings) or (self.work_is_model_time and rec.work_ns > 0)
        )
        if rec.spec_accepted:
            drafts = {e.ref: e.num_spec_tokens for e in rec.scheduled}
            for acc in rec.spec_accepted:
                self.spec[0] += 1
                self.spec[1] += drafts.get(acc.ref, 0)
                self.spec[2] += acc.accepted
        self.min_free = min(self.min_free, rec.free_slots if self.slots else rec.free_blocks)
        if rec.token_budget:
            self.budget_use += rec.num_scheduled_tokens / rec.token_budget

    def _clock(self) -> Clock:
        """The trace's clock: its step ends in seconds when timed, else step indices."""
        if not self.timed:
            return step_clock(self.fold)
        first = self.fold.steps[0] if self.fold.steps else 0
        starts = step_starts(self.ends, self.work, self.busy, self.idle)
        origin = self.reader.header.arrival_origin_ns
        arrivals = place_arrivals(
            self.fold, starts, first, None if origin is None else origin / 1e9
        )
        return Clock(SECONDS, first, self.ends, starts, arrivals)

    def _request(self, r: Lifecycle, clock: Clock) -> RequestStats:
        t = request_times(r, clock)
        first = r.sample_steps[0] if r.sample_steps else -1
        return RequestStats(
            r.request_id,
            r.arrival_step,
            first,
            r.finish_step,
            label(STATUS_LABELS, r.status) if r.status else "",
            r.num_prompt_tokens,
            r.num_samples,
            r.preemptions,
            r.hit_tokens[0] if r.hit_tokens else -1,
            t.ttft,
            t.tpot,
            t.e2e,
            t.queue,
            sum(r.hit_tokens[1:]),
        )

    def _groups(self, clock: Clock) -> list[GroupMetrics]:
        by = self.group_by
        assert by is not None
        found = {g.key: g for g in group_metrics(self.fold, clock, by.key)}
        return [found[k] for k in by.order(list(found))]

    def _summarise(self) -> TraceStats:
        clock = self._clock()
        m = run_metrics(self.fold, clock)
        requests = [self._request(self.fold.reqs[ref], clock) for ref in sorted(self.fold.reqs)]
        steps = len(self.ends)
        work = idle = 0.0
        if self.timed and all(w is not None for w in self.work):
            work = sum(w for w in self.work if w is not None)
            idle = max(0.0, self.ends[-1] - work) if steps else 0.0
        return TraceStats(
            unit=m.unit,
            num_steps=steps,
            duration_s=self.ends[-1] if steps and self.timed else 0.0,
            num_requests=m.num_requests,
            num_finished=m.num_finished,
            num_errors=m.num_errors,
            output_tokens=m.output_tokens,
            throughput=m.throughput,
            **latencies_of(m),
            preemptions=m.preemptions,
            prefix_hit_rate=m.prefix_hit_rate,
            peak_blocks=self.usable - self.min_free,
            usable_blocks=self.usable,
            mean_budget_use=self.budget_use / steps if steps else 0.0,
            requests=requests,
            spec_verifications=self.spec[0],
            spec_drafts=self.spec[1],
            spec_accepted=self.spec[2],
            num_aborted=m.num_aborted,
            server=server_stats(self.clients),
            prefix_hit_tokens=m.prefix_hit_tokens,
            readmit_hit_tokens=m.readmit_hit_tokens,
            readmit_query_tokens=m.readmit_query_tokens,
            work_s=work,
            idle_s=idle,
            kv_pool=self.reader.header.kv_pool,
            groups=None if self.group_by is None else self._groups(clock),
            group_by=self.group_by,
            queue_total=queue_total(self.fold, clock),
            totals=m,
        )


def format_stats(s: TraceStats) -> str:
    """The metrics as a small table."""
    u = s.unit
    rate = "tokens/s" if u == "s" else "tokens/step"
    span = ""
    if u == "s":
        span = f" in {s.duration_s:.2f} s"
        if s.work_s:
            span += f" (work {s.work_s:.2f} s, idle {s.idle_s:.2f} s)"
    rows = [
        ("steps", f"{s.num_steps}{span}"),
        (
            "requests",
            f"{s.num_requests} ({s.num_finished} finished, {s.num_errors} errors, "
            f"{s.num_aborted} aborted)",
        ),
        ("output tokens", f"{s.output_tokens}"),
        ("throughput", f"{s.throughput:.2f} {rate}"),
        ("engine TTFT p50 / p99", f"{_v(s.ttft_p50, u)} / {_v(s.ttft_p99, u)}"),
        ("engine TPOT p50 / p99", f"{_v(s.tpot_p50, u)} / {_v(s.tpot_p99, u)}"),
        ("engine ITL p50 / p99", f"{_v(s.itl_p50, u)} / {_v(s.itl_p99, u)}"),
        ("engine queue p50 / p99", f"{_v(s.queue_p50, u)} / {_v(s.queue_p99, u)}"),
        ("engine e2e p50 / p99", f"{_v(s.e2e_p50, u)} / {_v(s.e2e_p99, u)}"),
        ("preemptions", f"{s.preemptions}"),
        ("prefix-hit rate", f"{s.prefix_hit_rate:.1%}" + _readmits(s)),
        (
            "peak KV slots" if s.kv_pool == "tokens" else "peak KV blocks",
            f"{s.peak_blocks} of {s.usable_blocks}",
        ),
        ("budget use", f"{s.mean_budget_use:.1%} mean"),
    ]
    if s.acceptance_rate is not None:
        rows.append(
            (
                "spec decoding",
                f"{s.spec_accepted} of {s.spec_drafts} drafts accepted "
                f"({s.acceptance_rate:.1%}), mean acceptance length "
                f"{s.mean_acceptance_length:.2f} tokens",
            )
        )
    if s.server is not None:
        rows += format_server(s.server)
    width = max(len(k) for k, _ in rows)
    return printable("\n".join(f"{k:<{width}}  {v}" for k, v in rows))


def format_stat_groups(s: TraceStats) -> str | None:
    """The --group-by table (None: not grouped)."""
    if s.groups is None or s.group_by is None or s.totals is None:
        return None
    return format_groups(s.group_by, s.groups, s.totals, s.queue_total)


def _readmits(s: TraceStats) -> str:
    if not s.readmit_query_tokens:
        return ""
    return f" (re-admissions: {s.readmit_hit_tokens} of {s.readmit_query_tokens} tokens hit)"


def _v(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if unit == "s" else f"{x:.2f} steps"
