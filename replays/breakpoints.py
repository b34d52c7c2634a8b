"""Breakpoints: predicates over steps, and the search for the next or previous step where
any of them holds (docs/contracts.md R2). The TUI's n/N and `schedtop find` use this one module.

Event predicates (preempt, admit, first-token, finish) hit at every step where their event
happens. Condition predicates (free, slow, wait, util) are watchpoints: they hit where the
condition becomes true, not on every step while it holds (`free<8` hits at the step the
pool drops below 8 free blocks, and again only after it has been 8 or more in between).
Spelled with `while ` in front, a condition hits at every step where it holds. The
spellings, as the CLI and the TUI's dialog take them:

    preempt            a step that preempts any request
    preempt:ID         ... that preempts request ID
    admit:ID           request ID enters running (new or resumed)
    first-token:ID     request ID samples its first token
    finish:ID          request ID finishes (any reason)
    free<N             the step ends with fewer than N free KV blocks
    slow>T             the step took more than T milliseconds (end to end)
    wait>S             some request has waited more than S steps since arrival, never admitted
    util<P             the step used less than P% of its token budget
    while COND         COND (one of the four above) at every step where it holds
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from recorder.ids import answers_to, client_id
from recorder.schema import Status, Step
from replays.reducer import apply
from replays.state import State
from replays.timeline import Timeline

KINDS = ("preempt", "admit", "first-token", "finish", "free", "slow", "wait", "util")
CONDITIONS = frozenset(("free", "slow", "wait", "util"))  # watchpoints: hit when they become true
_NEEDS_ID = {"admit", "first-token", "finish"}
_SEGMENT = 64  # steps replayed at a time when searching backwards


@dataclass(frozen=True)
class Predicate:
    """One breakpoint condition."""

    kind: str  # one of KINDS
    request: str | None = None  # the request it watches (preempt, admit, first-token, finish)
    value: float = 0.0  # the threshold (free, slow, wait, util)
    level: bool = False  # a condition spelled `while ...`: hits at every step it holds

    def __str__(self) -> str:
        prefix = "while " if self.level else ""
        if self.kind in ("free", "util"):
            return f"{prefix}{self.kind}<{_num(self.value)}"
        if self.kind in ("slow", "wait"):
            return f"{prefix}{self.kind}>{_num(self.value)}"
        return self.kind if self.request is None else f"{self.kind}:{self.request}"

    @property
    def edge(self) -> bool:
        """A watchpoint: it hits where its condition becomes true."""
        return self.kind in CONDITIONS and not self.level

    @property
    def needs_state(self) -> bool:
        """Whether it reads the state after the step, not just the step record."""
        return self.kind in ("first-token", "wait")


_LEVEL = re.compile(r"^(free|util)\s*<\s*([0-9.]+)$|^(slow|wait)\s*>\s*([0-9.]+)$")


def parse(text: str) -> Predicate:
    """A predicate from its spelling; ValueError saying what is wrong."""
    t = text.strip()
    if t.lower().startswith("while "):
        inner = parse(t[6:])
        if inner.kind not in CONDITIONS or inner.level:
            raise ValueError(
                f"breakpoint {text!r}: `while` takes a condition: free<N, slow>MS, "
                "wait>STEPS or util<PERCENT"
            )
        return Predicate(inner.kind, value=inner.value, level=True)
    m = _LEVEL.match(t)
    if m:
        kind = m.group(1) or m.group(3)
        raw = m.group(2) or m.group(4)
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"breakpoint {text!r}: {raw!r} is not a number") from None
        return Predicate(kind, value=value)
    kind, sep, request = t.partition(":")
    kind = kind.strip().lower()
    request = request.strip()
    if kind not in KINDS or kind in ("free", "slow", "wait", "util"):
        raise ValueError(
            f"breakpoint {text!r}: unknown; use one of preempt, preempt:ID, "
            "admit:ID, first-token:ID, finish:ID, free<N, slow>MS, wait>STEPS, "
            "util<PERCENT, while CONDITION"
        )
    if kind in _NEEDS_ID and not request:
        raise ValueError(f"breakpoint {text!r}: {kind} needs a request id, as {kind}:ID")
    if sep and not request:
        raise ValueError(f"breakpoint {text!r}: empty request id after ':'")
    return Predicate(kind, request or None)


class Matcher:
    """Evaluates predicates step after step, in order, keeping what that needs: which refs
    name the watched requests, and when the previous step ended."""

    def __init__(
        self, predicates: Sequence[Predicate], start: State, prev_time_ns: int = 0
    ) -> None:
        self.predicates = list(predicates)
        watched = {p.request for p in predicates if p.request is not None}
        self.watched = watched
        # ref -> the name a predicate watches it by: its id, or its client id (vLLM's id
        # without its random suffix, recorder.ids), which stays the same across runs.
        self.refs: dict[int, str] = {}
        for ref, r in start.requests.items():
            self._watch(ref, r.request_id)
        self.prev_time_ns = prev_time_ns
        self.needs_state = any(p.needs_state for p in predicates)
        # Watched refs known to have sampled a token (first-token fires once per request).
        self.tokened = {
            ref for ref, r in start.requests.items() if ref in self.refs and r.num_output_tokens > 0
        }
        # Per predicate: whether its condition held at the step before (watchpoints hit
        # on the change only). Before the trace's first step nothing held.
        self.held = [False] * len(self.predicates)

    def prime(self, rec: Step, after: State, prev_time_ns: int) -> None:
        """Note which conditions held at the step before the first one `matches` sees
        (`rec`, the state after it, and when the step before it ended)."""
        self.prev_time_ns = prev_time_ns
        self.held = [p.edge and self._holds(p, rec, after) for p in self.predicates]

    def _watch(self, ref: int, request_id: str) -> None:
        if request_id in self.watched:
            self.refs[ref] = request_id
        elif self.watched and (short := client_id(request_id)) in self.watched:
            self.refs[ref] = short

    def observe(self, rec: Step) -> None:
        """Note the step's arrivals (call before `matches`, with every step in order)."""
        if self.watched:
            for a in rec.arrivals:
                self._watch(a.ref, a.request_id)

    def matches(self, rec: Step, after: State | None) -> bool:
        """Whether any predicate holds at `rec`'s step (`after`: the state after it,
        needed when `needs_state`)."""
        # Every predicate runs (no short-circuit): some keep per-request bookkeeping.
        hit = False
        for i, p in enumerate(self.predicates):
            holds = self._holds(p, rec, after)
            if p.edge:
                hit |= holds and not self.held[i]
                self.held[i] = holds
            else:
                hit |= holds
        self.prev_time_ns = rec.time_ns
        return hit

    def _holds(self, p: Predicate, rec: Step, after: State | None) -> bool:
        kind = p.kind
        if kind == "preempt":
            return bool(rec.preemptions) and (
                p.request is None
                or any(self.refs.get(x.victim) == p.request for x in rec.preemptions)
            )
        if kind == "admit":
            return any(self.refs.get(a.ref) == p.request for a in rec.admissions)
        if kind == "finish":
            return any(self.refs.get(f.ref) == p.request for f in rec.finishes)
        if kind == "free":
            return rec.free_blocks < p.value
        if kind == "slow":
            # the step's work, not the idle wait before it (format 1.4; docs/metrics.md)
            return rec.duration_ns(self.prev_time_ns) / 1e6 > p.value
        if kind == "util":
            return (
                rec.token_budget > 0
                and 100.0 * rec.num_scheduled_tokens / rec.token_budget < p.value
            )
        assert after is not None
        if kind == "first-token":
            return self._first_token(p.request, rec, after)
        if kind == "wait":
            return any(
                r.status == Status.WAITING
                and r.first_scheduled_step < 0
                and r.arrival_step >= 0
                and rec.step - r.arrival_step > p.value
                for r in after.requests.values()
            )
        raise AssertionError(kind)

    def _first_token(self, request: str | None, rec: Step, after: State) -> bool:
        hit = False
        for ref, name in self.refs.items():
            if name != request or ref in self.tokened:
                continue
            r = after.requests.get(ref)
            if r is not None and r.num_output_tokens > 0:
                hit = True
                self.tokened.add(ref)
        for f in rec.finishes:
            # A first token that also finished the request: it is gone from `after`.
            if (
                self.refs.get(f.ref) == request
                and f.ref not in self.tokened
                and f.status in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH_CAPPED)
            ):
                hit = True
                self.tokened.add(f.ref)
        return hit


def find(
    timeline: Timeline,
    predicates: Sequence[Predicate],
    start: int,
    backward: bool = False,
    limit: int | None = None,
) -> int | None:
    """The first step after `start` (or, `backward`, the last step before it) where any
    predicate holds; None when there is none. `limit` bounds the search (forwards: steps
    up to it; backwards: steps down to it), so that a caller can search a long trace in
    slices and stay responsive; slices give the same answers as one whole search."""
    if not predicates:
        return None
    if backward:
        floor = timeline.first_step if limit is None else max(limit, timeline.first_step)
        return _find_backward(timeline, predicates, start, floor)
    hi = timeline.last_step if limit is None else min(limit, timeline.last_step)
    return next(iter(_scan(timeline, predicates, start + 1, hi)), None)


def find_all(timeline: Timeline, predicates: Sequence[Predicate]) -> Iterable[int]:
    """Every step where any predicate holds, in order."""
    return _scan(timeline, predicates, timeline.first_step, timeline.last_step)


def _scan(timeline: Timeline, predicates: Sequence[Predicate], lo: int, hi: int) -> Iterable[int]:
    if lo > hi:
        return
    state = timeline.state(lo - 1).copy()
    prev_time = timeline.time_ns(lo - 1) if lo > timeline.first_step else 0
    matcher = Matcher(predicates, state, prev_time)
    if lo > timeline.first_step and any(p.edge for p in predicates):
        # Whether each watchpoint's condition held at the step before: a hit is a change.
        before = timeline.time_ns(lo - 2) if lo - 1 > timeline.first_step else 0
        matcher.prime(timeline.record(lo - 1), state, before)
        matcher.prev_time_ns = prev_time
    for step in range(lo, hi + 1):
        rec = timeline.record(step)
        matcher.observe(rec)
        if matcher.needs_state:
            apply(state, rec)
        if matcher.matches(rec, state):
            yield step


def about(timeline: Timeline, predicates: Sequence[Predicate], step: int) -> tuple[str, ...]:
    """The requests a hit at `step` is about, for a listing of hits (`find --names`):
    a preemption's victims, the request an `admit:`/`finish:`/`first-token:` names, the
    requests that had waited past a `wait>` threshold; none for pool and time conditions."""
    rec = timeline.record(step)
    before = timeline.state(step - 1)
    out: dict[str, None] = {}
    for p in predicates:
        if p.kind == "preempt":
            for x in rec.preemptions:
                rid = before.request_id(x.victim)
                if p.request is None or answers_to(rid, p.request):
                    out[rid] = None
        elif p.request is not None:
            out[p.request] = None
        elif p.kind == "wait":
            after = timeline.state(step)
            for r in after.requests.values():
                if (
                    r.status == Status.WAITING
                    and r.first_scheduled_step < 0
                    and r.arrival_step >= 0
                    and step - r.arrival_step > p.value
                ):
                    out[r.request_id] = None
    return tuple(out)


def _find_backward(
    timeline: Timeline, predicates: Sequence[Predicate], start: int, floor: int
) -> int | None:
    hi = min(start - 1, timeline.last_step)
    while hi >= floor:
        lo = max(floor, hi - _SEGMENT + 1)
        hits = list(_scan(timeline, predicates, lo, hi))
        if hits:
            return hits[-1]
        hi = lo - 1
    return None


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)
