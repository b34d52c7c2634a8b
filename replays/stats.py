"""The metrics of one trace: throughput, TTFT and TPOT percentiles, preemptions, prefix
hits, KV pressure. One pass with the reducer; memory grows with requests, not steps.

A trace of the real engine (its steps carry the model runner's timings) is measured in
seconds, from the step records' end times; a simulated one in steps, since its clock says
nothing about a model."""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from recorder.reader import TraceReader
from recorder.schema import STATUS_LABELS, RequestState, Snapshot, Step, label, percentile
from replays.reducer import apply, arrived
from replays.state import State


@dataclass
class RequestStats:
    """One request's life, as the trace tells it."""

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


@dataclass
class TraceStats:
    """The metrics of one trace."""

    unit: str  # "s" for a timed (real-engine) trace, "steps" for a simulated one
    num_steps: int  # step records
    duration_s: float  # from the first step's start to the last step's end
    num_requests: int  # arrivals
    num_finished: int  # finished (any reason)
    num_errors: int  # finished with FINISHED_ERROR
    output_tokens: int  # over every request
    throughput: float  # output tokens per second (timed) or per step (simulated)
    ttft_p50: float | None  # time to first token, median
    ttft_p99: float | None  # ... 99th percentile
    tpot_p50: float | None  # time per output token after the first, median
    tpot_p99: float | None  # ... 99th percentile
    preemptions: int  # preemptions over the trace
    prefix_hit_rate: float  # prompt tokens served by the prefix cache at first admission
    peak_blocks: int  # most KV blocks in use at the end of a step
    usable_blocks: int  # blocks in the pool, the null block aside
    mean_budget_use: float  # scheduled tokens / budget, averaged over steps
    requests: list[RequestStats] = field(default_factory=list)  # in arrival order

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trace_stats(path: str | Path) -> TraceStats:
    """Compute the metrics of the trace at `path` (its readable part, if it was cut)."""
    with TraceReader(path) as reader:
        return _Collector(reader).run()


class _Collector:
    def __init__(self, reader: TraceReader) -> None:
        self.reader = reader
        header = reader.header
        self.timed = False  # set at the end: whether any step carries runner timings
        self.usable = header.num_blocks - 1
        self.ends = array("q")  # each step's end, ns since recording started
        self.first_step = header.first_step
        self.reqs: dict[int, RequestState] = {}
        self.finish: dict[int, tuple[int, int]] = {}  # ref -> (step, status)
        self.min_free = self.usable
        self.preemptions = 0
        self.budget_use = 0.0

    def run(self) -> TraceStats:
        state: State | None = None
        for entry in self.reader.entries():
            rec = entry.record
            if not isinstance(rec, Step):
                if isinstance(rec, Snapshot) and state is None:
                    state = State.from_snapshot(self.reader.header, rec)
                    self.reqs.update(state.requests)
                continue
            if state is None:
                state = State.initial(self.reader.header)
            apply(state, rec, entry.offset)
            self._observe(rec, state)
        return self._summarise()

    def _observe(self, rec: Step, state: State) -> None:
        self.ends.append(rec.time_ns)
        self.timed = self.timed or bool(rec.timings)
        for a in rec.arrivals:
            r = state.requests.get(a.ref)
            if r is None:  # it finished in the same step (an error at arrival)
                r = arrived(a, rec.step)
            self.reqs[a.ref] = r
        for f in rec.finishes:
            self.finish[f.ref] = (rec.step, f.status)
        self.preemptions += len(rec.preemptions)
        self.min_free = min(self.min_free, rec.free_blocks)
        if rec.token_budget:
            self.budget_use += rec.num_scheduled_tokens / rec.token_budget

    def _time(self, step: int) -> float:
        """When `step` ended (seconds), or the step index itself when simulated."""
        if not self.timed:
            return float(step)
        i = step - self.first_step
        return self.ends[i] / 1e9 if 0 <= i < len(self.ends) else 0.0

    def _arrival(self, step: int) -> float:
        # A request arrives before its step starts: when the step before it ended.
        return self._time(step - 1) if self.timed else float(step - 1)

    def _request(self, ref: int, r: RequestState) -> RequestStats:
        finish_step, status = self.finish.get(ref, (-1, 0))
        first = r.first_token_step
        if first < 0 and r.num_output_tokens > 0:
            first = finish_step  # its first token was also its last
        ttft = self._time(first) - self._arrival(r.arrival_step) if first >= 0 else None
        tpot = None
        if first >= 0 and finish_step >= 0 and r.num_output_tokens > 1:
            tpot = (self._time(finish_step) - self._time(first)) / (r.num_output_tokens - 1)
        name = label(STATUS_LABELS, status) if status else ""
        return RequestStats(
            r.request_id,
            r.arrival_step,
            first,
            finish_step,
            name,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_preemptions,
            r.num_cached_tokens,
            ttft,
            tpot,
        )

    def _summarise(self) -> TraceStats:
        requests = [self._request(ref, r) for ref, r in sorted(self.reqs.items())]
        steps = len(self.ends)
        duration = self.ends[-1] / 1e9 if steps and self.timed else 0.0
        out_tokens = sum(r.output_tokens for r in requests)
        span = duration if self.timed else float(steps)
        admitted = [r for r in requests if r.cached_tokens >= 0]
        prompt = sum(r.prompt_tokens for r in admitted)
        ttft = [r.ttft for r in requests if r.ttft is not None]
        tpot = [r.tpot for r in requests if r.tpot is not None]
        return TraceStats(
            unit="s" if self.timed else "steps",
            num_steps=steps,
            duration_s=duration,
            num_requests=len(requests),
            num_finished=sum(1 for r in requests if r.finish_step >= 0),
            num_errors=sum(1 for r in requests if r.status == "error"),
            output_tokens=out_tokens,
            throughput=out_tokens / span if span else 0.0,
            ttft_p50=percentile(ttft, 50),
            ttft_p99=percentile(ttft, 99),
            tpot_p50=percentile(tpot, 50),
            tpot_p99=percentile(tpot, 99),
            preemptions=self.preemptions,
            prefix_hit_rate=sum(r.cached_tokens for r in admitted) / prompt if prompt else 0.0,
            peak_blocks=self.usable - self.min_free,
            usable_blocks=self.usable,
            mean_budget_use=self.budget_use / steps if steps else 0.0,
            requests=requests,
        )


def format_stats(s: TraceStats) -> str:
    """The metrics as a small table."""
    u = s.unit
    rate = "tokens/s" if u == "s" else "tokens/step"
    rows = [
        ("steps", f"{s.num_steps}" + (f" in {s.duration_s:.2f} s" if u == "s" else "")),
        ("requests", f"{s.num_requests} ({s.num_finished} finished, {s.num_errors} errors)"),
        ("output tokens", f"{s.output_tokens}"),
        ("throughput", f"{s.throughput:.2f} {rate}"),
        ("TTFT p50 / p99", f"{_v(s.ttft_p50, u)} / {_v(s.ttft_p99, u)}"),
        ("TPOT p50 / p99", f"{_v(s.tpot_p50, u)} / {_v(s.tpot_p99, u)}"),
        ("preemptions", f"{s.preemptions}"),
        ("prefix-hit rate", f"{s.prefix_hit_rate:.1%}"),
        ("peak KV blocks", f"{s.peak_blocks} of {s.usable_blocks}"),
        ("budget use", f"{s.mean_budget_use:.1%} mean"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _v(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if unit == "s" else f"{x:.2f} steps"
