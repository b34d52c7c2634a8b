"""Comparing traces: the first step where two traces decide differently, and what the
difference did to the metrics (docs/contracts.md R4). `schedtop diff` exits 0 when the decisions
are identical, 1 when they differ, 2 on bad input, so it serves as a regression test."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

from recorder.derive import leading_decodes, running_after
from recorder.ids import client_id
from recorder.multi import open_trace
from recorder.schema import (
    KIND_LABELS,
    REASON_LABELS,
    STATUS_LABELS,
    Arrival,
    Kind,
    Status,
    Step,
    label,
    printable,
)
from replays.groups import GroupBy, format_group_change
from replays.reducer import StepView
from replays.stats import TraceStats, trace_stats
from replays.timeline import Timeline

# Fields that differ from run to run with the same decisions.
TIMING_FIELDS = frozenset({"time_ns", "schedule_ns", "update_ns", "timings", "work_ns"})
# ... and the budget, a setting rather than a decision: a bigger budget that changes
# nothing should not be reported as a difference.
_MASKED = TIMING_FIELDS | {"token_budget"}
_COMPARED = tuple(f.name for f in fields(Step) if f.name not in _MASKED)
# Across engines, what each engine keeps its own way rather than decides: when samples
# come back (SGLang's overlap loop reports a batch's a step late) and how the pool is
# accounted (blocks here, token slots there).
BOOKKEEPING_FIELDS = frozenset(
    {
        "sample_counts",
        "sampled_tokens",
        "other_samples",
        "kv_events",
        "free_blocks_after_schedule",
        "free_blocks",
        "free_slots",
        "cached_slots",
        "evicted_slots",
        "slot_allocs",
        "slot_writes",
        "slots_freed_first",
        "slots_freed",
        "evictable_slots",
    }
)
_DECISIONS = tuple(name for name in _COMPARED if name not in BOOKKEEPING_FIELDS)


def differing_fields(
    a: Step, b: Step, across_runs: bool = False, decisions_only: bool = False
) -> tuple[str, ...]:
    """The fields of two step records that differ, timings and the budget aside.
    `across_runs`: the steps are of two recordings of one workload (two vLLM runs), whose
    arrivals are the same requests under vLLM's random id suffixes and at other wall
    times: arrivals are compared by client id (recorder.ids), without arrival_time."""
    compared = _DECISIONS if decisions_only else _COMPARED
    out = tuple(name for name in compared if getattr(a, name) != getattr(b, name))
    if "arrivals" in out and (
        _untenanted(a.arrivals) == _untenanted(b.arrivals)
        or (across_runs and _same_arrivals(a.arrivals, b.arrivals))
    ):
        out = tuple(name for name in out if name != "arrivals")
    return out


# The fields that hold a step's scheduled entries: two records may write the same entries
# in two forms (format 1.7's decode_skips passes over running requests; a writer before
# it, or schedtop's own, spells the entries after such a request out).
ENTRY_FIELDS = frozenset({"num_decodes", "scheduled", "decode_skips"})


class EntryForms:
    """Compares the entries of two traces' steps when only their form differs, by
    expanding both against the running queue the two share (tracked from their records,
    from step 0; a trace that starts mid-run is compared field by field)."""

    def __init__(self) -> None:
        self.running: tuple[int, ...] | None = None  # None: not known
        self.next_step = 0

    def differing(self, a: Step, b: Step, fields_: tuple[str, ...]) -> tuple[str, ...]:
        """`fields_` (differing_fields(a, b)) without the entry fields when a's and b's
        entries are the same once expanded; then the queue moves on with `a`."""
        if a.step == 0:
            self.running = ()
        elif a.step != self.next_step:
            self.running = None
        if (
            fields_
            and self.running is not None
            and ENTRY_FIELDS.intersection(fields_)
            and _expanded(a, self.running) == _expanded(b, self.running) is not None
        ):
            fields_ = tuple(f for f in fields_ if f not in ENTRY_FIELDS)
        if self.running is not None:
            self.running = _running_after(a, self.running)
        self.next_step = a.step + 1
        return fields_


def _expanded(rec: Step, running: tuple[int, ...]) -> list[tuple[int, int, int, int]] | None:
    """Every scheduled entry of `rec` as (ref, tokens, kind, spec tokens), the implicit
    decodes included (their computed tokens are the state's, so only refs compare)."""
    aborted = {f.ref for f in rec.finishes if f.status == Status.FINISHED_ABORTED}
    base = [r for r in running if r not in aborted]
    try:
        lead = leading_decodes(base, rec.num_decodes, rec.decode_skips)
    except ValueError:
        return None
    decode = int(Kind.DECODE)
    return [(r, 1, decode, 0) for r in lead] + [
        (e.ref, e.num_tokens, int(e.kind), e.num_spec_tokens) for e in rec.scheduled
    ]


def _running_after(rec: Step, running: tuple[int, ...]) -> tuple[int, ...]:
    if rec.running is not None:
        return rec.running
    if not (rec.admissions or rec.finishes or rec.preemptions):
        return running
    gone = {f.ref for f in rec.finishes} | {p.victim for p in rec.preemptions}
    return tuple(running_after(running, gone, [x.ref for x in rec.admissions]))


def _untenanted(arrivals: tuple[Arrival, ...]) -> list[Arrival]:
    """A request's tenant is a label, not a decision: a scheduler that does not record
    one (vLLM's, under resim --engine vllm) decides the same."""
    return [replace(x, tenant=None) if x.tenant is not None else x for x in arrivals]


def _same_arrivals(a: tuple[Arrival, ...], b: tuple[Arrival, ...]) -> bool:
    def key(x: Arrival) -> Arrival:
        return replace(x, request_id=client_id(x.request_id), arrival_time=0.0, tenant=None)

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


@dataclass(frozen=True)
class StepSide:
    """One trace's decisions at a step, spelled out with request ids."""

    scheduled: dict[str, int]  # request id -> tokens, in scheduling order
    kinds: dict[str, str]  # request id -> prefill / chunk / decode / spec
    admitted: list[str]  # e.g. "req-3 (cached 32)"
    preempted: list[str]  # e.g. "req-7 for req-2 (lost 96 tokens)"
    finished: list[str]  # e.g. "req-1 (length)"
    reasons: list[str]  # why requests were cut short or left out


@dataclass
class TraceDiff:
    """Two traces compared."""

    a: Path  # the first trace
    b: Path  # the second
    first_step: int | None  # the first step whose decisions differ (None: identical)
    fields: tuple[str, ...]  # what differs at that step
    side_a: StepSide | None  # A's decisions at that step (None: A has no such step)
    side_b: StepSide | None  # B's
    steps_differing: int  # steps whose decisions differ, counting steps only one side has
    requests_affected: list[str]  # requests whose outcome differs (timing, tokens, ...)
    stats_a: TraceStats  # A's metrics
    stats_b: TraceStats  # B's
    group_by: GroupBy | None = None  # the metrics were grouped too (their `groups`)

    @property
    def identical(self) -> bool:
        return self.first_step is None

    def to_json(self) -> dict[str, Any]:
        """`schedtop diff --json`: the first difference and both sides' metrics (with
        --group-by, their groups inside them); the requests per side are left out."""
        sides = {}
        for name, s in (("a", self.stats_a), ("b", self.stats_b)):
            stats = s.to_json()
            stats.pop("requests", None)
            sides[name] = stats
        return {
            "a": str(self.a),
            "b": str(self.b),
            "identical": self.identical,
            "first_step": self.first_step,
            "fields": list(self.fields),
            "steps_differing": self.steps_differing,
            "requests_affected": self.requests_affected,
            **{f"stats_{k}": v for k, v in sides.items()},
        }


def diff_traces(
    a: str | Path,
    b: str | Path,
    decisions_only: bool = False,
    group_by: GroupBy | None = None,
) -> TraceDiff:
    """Compare the decisions of two traces step by step, then their metrics (with
    `group_by`, each group's too). `decisions_only`: two engines' traces, their
    BOOKKEEPING_FIELDS not compared."""
    a, b = Path(a), Path(b)
    first: int | None = None
    what: tuple[str, ...] = ()
    differing = 0
    with open_trace(a) as ra, open_trace(b) as rb:
        # Two vLLM recordings: their request ids differ by vLLM's random suffixes.
        across = ra.header.engine.startswith("vLLM") and rb.header.engine.startswith("vLLM")
        forms = EntryForms()
        for rec_a, rec_b in zip_longest(ra.steps(), rb.steps()):
            fields_: tuple[str, ...]
            if rec_a is None or rec_b is None:
                fields_ = ("steps",)
            else:
                fields_ = differing_fields(rec_a, rec_b, across, decisions_only)
                fields_ = forms.differing(rec_a, rec_b, fields_)
            if fields_:
                differing += 1
                if first is None:
                    present = rec_a if rec_a is not None else rec_b
                    assert present is not None
                    first = present.step
                    what = fields_
    stats_a, stats_b = trace_stats(a, group_by), trace_stats(b, group_by)
    side_a = side_b = None
    if first is not None:
        side_a, side_b = _side(a, first), _side(b, first)
    return TraceDiff(
        a,
        b,
        first,
        what,
        side_a,
        side_b,
        differing,
        _affected(stats_a, stats_b),
        stats_a,
        stats_b,
        group_by,
    )


def _side(path: Path, step: int) -> StepSide | None:
    with open_trace(path) as reader:
        timeline = Timeline(reader)
        if step > timeline.last_step:
            return None
        view = timeline.view(step)
        return describe(view)


def describe(view: StepView) -> StepSide:
    """A step's decisions with request ids instead of refs."""
    names = view.names
    rec = view.record
    kinds = {names[e.ref]: label(KIND_LABELS, e.kind) for e in view.scheduled}
    return StepSide(
        scheduled={names[e.ref]: e.num_tokens for e in view.scheduled},
        kinds=kinds,
        admitted=[
            f"{names[x.ref]} (cached {x.cached_tokens}" + (", resumed)" if x.resumed else ")")
            for x in rec.admissions
        ],
        preempted=[
            f"{names[p.victim]} for {names[p.for_request]} (lost {p.tokens_lost} tokens)"
            for p in rec.preemptions
        ],
        finished=[f"{names[f.ref]} ({label(STATUS_LABELS, f.status)})" for f in rec.finishes],
        reasons=[
            f"{names[s.ref]}: {s.got} of {s.wanted} tokens, {label(REASON_LABELS, s.reason)}"
            for s in rec.shortfalls
        ]
        + [
            f"{which} pass stopped: {label(REASON_LABELS, q.head)}, then "
            f"{label(REASON_LABELS, q.rest)}"
            for which, q in (("running", rec.running_stop), ("waiting", rec.waiting_stop))
            if q is not None
        ],
    )


def _affected(a: TraceStats, b: TraceStats) -> list[str]:
    """Requests (matched by arrival order) whose outcome differs between the traces."""
    out = []
    for ra, rb in zip_longest(a.requests, b.requests):
        if ra is None or rb is None:
            present = ra if ra is not None else rb
            assert present is not None
            out.append(present.request_id)
            continue
        if (
            ra.first_token_step,
            ra.finish_step,
            ra.status,
            ra.output_tokens,
            ra.preemptions,
            ra.cached_tokens,
        ) != (
            rb.first_token_step,
            rb.finish_step,
            rb.status,
            rb.output_tokens,
            rb.preemptions,
            rb.cached_tokens,
        ):
            out.append(ra.request_id)
    return out


_METRICS = (
    ("throughput", "throughput"),
    ("TTFT p50", "ttft_p50"),
    ("TTFT p99", "ttft_p99"),
    ("TPOT p50", "tpot_p50"),
    ("TPOT p99", "tpot_p99"),
    ("preemptions", "preemptions"),
    ("prefix-hit rate", "prefix_hit_rate"),
    ("peak KV blocks", "peak_blocks"),
    ("steps", "num_steps"),
)


def format_diff(d: TraceDiff, max_entries: int = 12) -> str:
    lines = [f"A: {d.a}", f"B: {d.b}"]
    if d.identical:
        lines.append(f"identical decisions over {d.stats_a.num_steps} steps")
    else:
        lines.append(f"first difference at step {d.first_step}: {', '.join(d.fields)}")
        for name, side in (("A", d.side_a), ("B", d.side_b)):
            lines += _format_side(name, side, max_entries)
        lines.append(
            f"{d.steps_differing} steps differ; {len(d.requests_affected)} "
            "requests affected"
            + (
                ": "
                + ", ".join(d.requests_affected[:10])
                + (" ..." if len(d.requests_affected) > 10 else "")
                if d.requests_affected
                else ""
            )
        )
    lines.append("")
    unit = d.stats_a.unit
    lines.append(f"{'metric':<16} {'A':>12} {'B':>12} {'B - A':>12}")
    for name, attr in _METRICS:
        va, vb = getattr(d.stats_a, attr), getattr(d.stats_b, attr)
        lines.append(
            f"{name:<16} {_fmt(va, attr, unit):>12} {_fmt(vb, attr, unit):>12} "
            f"{_delta(va, vb, attr, unit):>12}"
        )
    ga, gb = d.stats_a.groups, d.stats_b.groups
    if d.group_by is not None and ga is not None and gb is not None:
        lines += ["", format_group_change(d.group_by, ga, gb, unit)]
    return printable("\n".join(lines))


def _format_side(name: str, side: StepSide | None, max_entries: int) -> list[str]:
    if side is None:
        return [f"  {name}: no such step (the trace ended)"]
    items = list(side.scheduled.items())
    shown = ", ".join(f"{rid} {n} {side.kinds[rid]}" for rid, n in items[:max_entries])
    more = f", ... {len(items) - max_entries} more" if len(items) > max_entries else ""
    out = [f"  {name} scheduled {sum(side.scheduled.values())} tokens: {shown}{more}"]
    for what, values in (
        ("admitted", side.admitted),
        ("preempted", side.preempted),
        ("finished", side.finished),
        ("why", side.reasons),
    ):
        if values:
            out.append(f"  {name} {what}: " + "; ".join(values))
    return out


def _fmt(v: float | int | None, attr: str, unit: str, signed: bool = False) -> str:
    """A metric's value (`signed`: a difference of two, with its sign) in its unit."""
    if v is None:
        return "-"
    sign = "+" if signed else ""
    if attr.startswith(("ttft", "tpot")):
        return f"{v * 1e3:{sign}.1f} ms" if unit == "s" else f"{v:{sign}.2f}"
    if attr == "prefix_hit_rate":
        return f"{v * 100:+.1f} pt" if signed else f"{v:.1%}"
    if attr == "throughput" or (signed and not isinstance(v, int)):
        return f"{v:{sign}.2f}"
    return f"{v:+d}" if signed else str(v)


def _delta(a: float | int | None, b: float | int | None, attr: str, unit: str) -> str:
    return "-" if a is None or b is None else _fmt(b - a, attr, unit, signed=True)
