"""Trying a fix: one knob changed, the run again, and what it did per request and per
group next to the recording (the TUI's `x` on the incidents view, in a worker thread).

A simulated trace is re-simulated in steps (`resim --set`); a trace with real step
timings is predicted in time (`whatif --set`). Either way the new run is written to a
temporary trace and measured with the same fold as the recording (`trace_stats` with a
`--group-by`), then the file goes.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from replays.groups import GroupBy, parse_group_by

if TYPE_CHECKING:  # the runs are imported when one is tried: the TUI imports this at start
    from engine.metrics import GroupMetrics
    from replays.stats import RequestStats

# The value a reason's knob is first tried with (the prompt shows it, editable): the
# setting that lifts the limit, or twice the recorded size.
_LIFTS = {"scheduler_reserve_full_isl": "false", "watermark": "0.0"}
_DOUBLED = ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_num_active_seqs")


def suggest(knob: str, config: dict[str, object]) -> str:
    """`KNOB=VALUE` to try first for a knob a reason names ("" for no knob)."""
    if not knob:
        return ""
    if knob in _LIFTS:
        return f"{knob}={_LIFTS[knob]}"
    value = config.get(knob)
    if knob in _DOUBLED and isinstance(value, int) and not isinstance(value, bool):
        return f"{knob}={value * 2}"
    return f"{knob}="


@dataclass(frozen=True, slots=True)
class RequestChange:
    """One request's queue time and TTFT, recorded and with the fix."""

    request_id: str
    queue: tuple[float | None, float | None]
    ttft: tuple[float | None, float | None]


@dataclass(frozen=True, slots=True)
class GroupChange:
    """One group's figures, recorded and with the fix."""

    key: str
    requests: int
    ttft_p99: tuple[float | None, float | None]
    queue_p99: tuple[float | None, float | None]
    queue_total: tuple[float, float]


@dataclass(frozen=True, slots=True)
class FixOutcome:
    """What a change did: `how` ran it ("resim" or "whatif"), in `unit` ("s" or "steps")."""

    setting: str  # as typed: "watermark=0.1"
    how: str  # "resim" (steps) or "whatif" (a timed trace, in seconds)
    unit: str
    first_difference: int | None  # the first step that decides differently (None: none)
    group_title: str  # "prio" or the pattern
    groups: tuple[GroupChange, ...]
    requests: tuple[RequestChange, ...]  # the requests asked about, in that order


def try_fix(
    path: str | Path,
    setting: str,
    about: Sequence[str] = (),
    group_by: GroupBy | None = None,
) -> FixOutcome:
    """Run the trace at `path` again with `setting` (`KNOB=VALUE`) and compare, per
    group (by priority unless `group_by`) and for the requests `about`. UserError for a
    setting or a trace that cannot be tried."""
    from engine.sim.api import parse_settings
    from recorder.multi import open_trace
    from replays.stats import trace_stats

    overrides = parse_settings([setting])
    by = group_by if group_by is not None else parse_group_by("prio")
    with open_trace(path) as reader:
        # A simulation's clock says nothing about a model: straight to steps. Anything
        # else is tried in time first; whatif says when its steps carry no timings.
        timed = not reader.header.engine.endswith("(SimRunner)")
    fd, tmp = tempfile.mkstemp(suffix=".trace", prefix="schedtop-fix-")
    os.close(fd)
    os.unlink(tmp)  # the runs refuse to overwrite: they make it
    try:
        how, first = "resim", None
        if timed:
            from recorder.errors import TraceError
            from replays.whatif import WhatifError, whatif

            try:
                r = whatif(path, overrides, out=tmp)
                how, first = "whatif", r.first_difference
            except (WhatifError, TraceError):
                # no usable step timings, or a form whatif does not read (a server's run
                # directory): in steps, then; a bad setting is no WhatifError and goes up
                timed = False
                Path(tmp).unlink(missing_ok=True)
        if not timed:
            from replays.resim import resimulate

            res = resimulate(path, overrides, tmp)
            first = None if res.divergence is None else res.divergence.step
        before, after = trace_stats(path, by), trace_stats(tmp, by)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return FixOutcome(
        setting,
        how,
        after.unit,
        first,
        by.title if by.by_priority else by.spec,
        _groups(by, before.groups or [], after.groups or []),
        _requests(about, before.requests, after.requests),
    )


def _groups(
    by: GroupBy, a: Iterable[GroupMetrics], b: Iterable[GroupMetrics]
) -> tuple[GroupChange, ...]:
    ga, gb = {g.key: g for g in a}, {g.key: g for g in b}
    out = []
    for key in by.order(list(dict.fromkeys([*ga, *gb]))):
        x, y = ga.get(key), gb.get(key)
        either = x if x is not None else y
        assert either is not None
        out.append(
            GroupChange(
                key,
                either.metrics.num_requests,
                (x.metrics.ttft_p99 if x else None, y.metrics.ttft_p99 if y else None),
                (x.metrics.queue_p99 if x else None, y.metrics.queue_p99 if y else None),
                (x.queue_total if x else 0.0, y.queue_total if y else 0.0),
            )
        )
    return tuple(out)


def _requests(
    about: Sequence[str], a: Sequence[RequestStats], b: Sequence[RequestStats]
) -> tuple[RequestChange, ...]:
    # Matched by id: the re-run adds the recording's requests under their own ids.
    ra = {r.request_id: r for r in a}
    rb = {r.request_id: r for r in b}
    out = []
    for rid in about:
        x, y = ra.get(rid), rb.get(rid)
        if x is None and y is None:
            continue
        out.append(
            RequestChange(
                rid,
                (x.queue if x else None, y.queue if y else None),
                (x.ttft if x else None, y.ttft if y else None),
            )
        )
    return tuple(out)
