"""`--group-by prio|REGEX`: a run's figures per group of requests, side by side.

Totals hide who paid: a priority storm's p99 is the low-priority work's, a RAG flood's
the chats'. The figures per group are engine.metrics' own (`group_metrics`: run_metrics
over each group's requests, on the run's clock), so that a group's TTFT means what the
totals' TTFT means, and the counts, tokens and summed queue time add up to the totals.

A group is a request's priority (`prio`), its tenant (`tenant`: the workload's `tenant`
field or the client's `user`, as its arrival recorded it; `(none)` without one), or a
regular expression's match in its id (the client's id: vLLM's random suffix aside): the
first group when the pattern has one, else the whole match; ids it does not match form
the group `(other)`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import UserError
from engine.metrics import GroupMetrics, Lifecycle, RunMetrics
from recorder.ids import client_id
from recorder.schema import printable

OTHER = "(other)"  # the group of ids a pattern does not match
NO_TENANT = "(none)"  # the group of requests that arrived without a tenant
TENANT = "tenant"


class GroupByError(UserError, ValueError):
    """A --group-by that cannot group (a bad regular expression)."""


@dataclass(frozen=True)
class GroupBy:
    """How requests are grouped: by priority, by tenant, or by a pattern's match in
    their id."""

    spec: str  # as given: "prio", "tenant" or a regular expression
    pattern: re.Pattern[str] | None  # None: by priority or tenant

    @property
    def by_priority(self) -> bool:
        return self.pattern is None and self.spec != TENANT

    @property
    def title(self) -> str:
        if self.pattern is None:
            return "prio" if self.by_priority else "tenant"
        return "group"

    def key(self, life: Lifecycle) -> str:
        if self.pattern is None:
            if self.spec == TENANT:
                return life.tenant or NO_TENANT
            return str(life.priority)
        m = self.pattern.search(client_id(life.request_id))
        if m is None:
            return OTHER
        return (m.group(1) if self.pattern.groups else m.group(0)) or OTHER

    def order(self, keys: Sequence[str]) -> list[str]:
        """Groups in the order to print: priorities best first, else by name."""
        if self.by_priority:
            return sorted(keys, key=int)
        return sorted(keys, key=lambda k: (k in (OTHER, NO_TENANT), k))


def parse_group_by(spec: str) -> GroupBy:
    """`prio` (or `priority`), `tenant`, or a regular expression over request ids."""
    if spec in ("prio", "priority", TENANT):
        return GroupBy(spec, None)
    if not spec:
        raise GroupByError("--group-by: empty; give prio or a regular expression")
    try:
        return GroupBy(spec, re.compile(spec))
    except re.error as e:
        raise GroupByError(f"--group-by {spec!r}: not a regular expression: {e}") from None


def grouper(group_by: GroupBy | None) -> Callable[[Lifecycle], str] | None:
    return None if group_by is None else group_by.key


# -- tables -------------------------------------------------------------------------------------

_LATENCY = (("TTFT", "ttft"), ("TPOT", "tpot"), ("queue", "queue"))


def _v(x: float | None, unit: str) -> str:
    """A latency: ms on a timed run, steps on a simulated one (the title says which)."""
    if x is None:
        return "-"
    return f"{x * 1e3:.1f}" if unit == "s" else f"{x:.2f}"


def _total(x: float, unit: str) -> str:
    """A summed queue time: seconds on a timed run, steps on a simulated one."""
    return f"{x:.2f}" if unit == "s" else f"{x:.0f}"


def format_groups(
    group_by: GroupBy, groups: Sequence[GroupMetrics], total: RunMetrics, total_queue: float
) -> str:
    """One row per group, then the totals' row: requests, finished, output tokens,
    preemptions, TTFT / TPOT / queue p50 and p99, and the queue time summed (80 columns
    on a timed trace's figures)."""
    unit = total.unit
    by = {g.key: g for g in groups}
    head = [
        group_by.title,
        "reqs",
        "done",
        "tokens",  # output tokens
        "pre",  # preemptions
        *(f"{n} 50/99" for n, _ in _LATENCY),  # p50 and p99
        "queue sum",
    ]
    rows = [head]
    for key in group_by.order(list(by)):
        g = by[key]
        rows.append(_row(printable(key), g.metrics, g.queue_total, unit))
    rows.append(_row("all", total, total_queue, unit))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for i, r in enumerate(rows):
        out.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))
            )
        )
        if i == 0 or i == len(rows) - 2:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join([_title(group_by, unit), *out])


def _row(key: str, m: RunMetrics, queue: float, unit: str) -> list[str]:
    return [
        key,
        str(m.num_requests),
        str(m.num_finished),
        str(m.output_tokens),
        str(m.preemptions),
        *(
            f"{_v(getattr(m, a + '_p50'), unit)}/{_v(getattr(m, a + '_p99'), unit)}"
            for _, a in _LATENCY
        ),
        _total(queue, unit),
    ]


_COMPARED = (("TTFT p99", "ttft_p99"), ("TPOT p99", "tpot_p99"), ("queue p99", "queue_p99"))


def format_group_change(
    group_by: GroupBy,
    a: Sequence[GroupMetrics],
    b: Sequence[GroupMetrics],
    unit: str,
    names: tuple[str, str] = ("A", "B"),
) -> str:
    """Two runs' groups side by side: per group, its requests, then a line per figure
    (each p99, the summed queue time) in A and B with the change; narrow enough for 80
    columns whatever the groups."""
    ga, gb = {g.key: g for g in a}, {g.key: g for g in b}
    head = [group_by.title, "reqs", "figure", names[0], names[1], "change"]
    rows = [head]
    firsts = set()  # rows that begin a group (a rule goes above them)
    for key in group_by.order(list(dict.fromkeys([*ga, *gb]))):
        x, y = ga.get(key), gb.get(key)
        either = x if x is not None else y
        assert either is not None
        firsts.add(len(rows))
        lead = [printable(key), str(either.metrics.num_requests)]
        for label, attr in _COMPARED:
            va = getattr(x.metrics, attr) if x is not None else None
            vb = getattr(y.metrics, attr) if y is not None else None
            rows.append([*lead, label, _v(va, unit), _v(vb, unit), _change(va, vb)])
            lead = ["", ""]
        qa = x.queue_total if x is not None else None
        qb = y.queue_total if y is not None else None
        rows.append(
            [
                *lead,
                "queue sum",
                _total(qa, unit) if qa is not None else "-",
                _total(qb, unit) if qb is not None else "-",
                _change(qa, qb),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = []
    for i, r in enumerate(rows):
        if i in firsts and i > 1:
            out.append("")
        out.append(
            "  ".join(
                c.ljust(w) if j in (0, 2) else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join([_title(group_by, unit), *out])


def _title(group_by: GroupBy, unit: str) -> str:
    what = (
        "priority"
        if group_by.by_priority
        else TENANT
        if group_by.spec == TENANT
        else f"'{printable(group_by.spec)}'"
    )
    units = "latencies in ms, queue sum in s" if unit == "s" else "in steps"
    return f"by {what} ({units})"


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    if a == 0:
        return "0%" if b == 0 else "new"
    return f"{(b - a) / a:+.0%}"
