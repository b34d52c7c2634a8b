"""Incidents: every preemption, abort and error of a trace, and the storm they make.

A preemption storm is read as a list, not step by step: which request was preempted, for
whom, how many computed tokens it threw away, how full the pool was, and whether it is
thrashing (preempted again soon after it got back in, or over and over). The scan reads
the step records' few fields it needs straight from their msgpack bodies (arrivals,
admissions, preemptions, finishes, free blocks, scheduled tokens) and never replays the
block map, so a million-step trace is scanned at the speed of reading it; the TUI runs it
in slices in its reader thread, and `schedtop stats` in one go.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any

from recorder.codec import STEP, decode
from recorder.encoding import Bad, unpack_body
from recorder.errors import TraceError
from recorder.ids import client_id
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.schema import (
    Admission,
    Arrival,
    Finish,
    Preemption,
    RecordType,
    Scheduled,
    Snapshot,
    Status,
)
from replays.scan import Digested, RecordScan

THRASH_STEPS = 8  # preempted again within this many steps of getting back in: thrash
REPEAT = 3  # preempted this many times or more: a repeat victim
TOP_VICTIMS = 5  # victims named in the summary


class IncidentKind(enum.StrEnum):
    """What an incident is (a str, so that the TUI's colour tables and a query's words
    compare with it as they are)."""

    PREEMPT = "preempt"
    ABORT = "abort"
    ERROR = "error"


_CODECS: dict[str, tuple[int, Any]] = {name: (key, codec) for key, name, codec in STEP.fields}


@dataclass(frozen=True, slots=True)
class Incident:
    """One preemption, abort or error."""

    step: int  # the step it happened in
    kind: IncidentKind
    request_id: str  # the victim (preempt) or the request that ended
    cause: str  # preempt: for whom ("itself" when it was its own allocation); error: message
    tokens_lost: int  # preempt: computed tokens thrown away, to be computed again
    free_before: int  # free KV blocks when the step began
    free_after: int  # free KV blocks right after the step's schedule()
    count: int  # preempt: the request's preemptions so far, this one included
    thrash: str  # why it is flagged as thrash ("" when it is not)


@dataclass(frozen=True, slots=True)
class StormSummary:
    """The storm in numbers, over the steps scanned."""

    steps: int  # step records scanned
    preemptions: int  # preemptions in them
    tokens_lost: int  # computed tokens thrown away by those preemptions
    computed_tokens: int  # tokens scheduled (computed) in them, recomputation included
    thrash: int  # preemptions flagged as thrash
    aborts: int  # requests aborted
    errors: int  # requests finished with an error
    top_victims: tuple[tuple[str, int], ...]  # (request id, preemptions), most first

    @property
    def per_1k_steps(self) -> float:
        return 1000.0 * self.preemptions / self.steps if self.steps else 0.0

    @property
    def lost_share(self) -> float:
        """Recompute tokens lost as a share of every computed token."""
        return self.tokens_lost / self.computed_tokens if self.computed_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        """`schedtop stats --json`'s "storm"."""
        out: dict[str, Any] = asdict(self)
        return {**out, "per_1k_steps": self.per_1k_steps, "lost_share": self.lost_share}


class IncidentScan(RecordScan):
    """The incidents found so far, a slice of the trace at a time (`advance`). It reads
    the few fields it counts straight from the step records' bodies."""

    def __init__(self, reader: TraceReader, tail: bool = False) -> None:
        super().__init__(reader, tail)
        self.incidents: list[Incident] = []
        self.done = False  # the END record was read (a live trace may still grow otherwise)
        self.ids: set[str] = set()  # every request id seen so far (to check breakpoints)
        self._names: dict[int, str] = {}  # refs of unfinished requests -> ids
        self._counts: dict[int, int] = {}  # unfinished refs -> preemptions so far
        self._back_in: dict[int, int] = {}  # unfinished refs -> step of their last admission
        self._free = reader.header.num_blocks - 1  # free blocks after the last step
        self._victims: Counter[str] = Counter()
        self._steps = self._lost = self._computed = self._thrash = 0
        self._aborts = self._errors = 0

    def _record(self, offset: int, rtype: int, body: bytes) -> bool:
        if rtype == RecordType.STEP:
            try:
                self._step(unpack_body(body))
            except Bad as e:
                raise TraceError(f"step record: {e.message()}", offset) from None
            return True
        if rtype == RecordType.SNAPSHOT and self._steps == 0:
            self._snapshot(decode(rtype, body, offset))
        elif rtype == RecordType.END:
            self.done = True
        return False

    def summary(self) -> StormSummary:
        return StormSummary(
            self._steps,
            sum(1 for i in self.incidents if i.kind == IncidentKind.PREEMPT),
            self._lost,
            self._computed,
            self._thrash,
            self._aborts,
            self._errors,
            tuple(self._victims.most_common(TOP_VICTIMS)),
        )

    def _snapshot(self, snap: object) -> None:
        """A trace that starts mid-run names its requests in its first snapshot."""
        if not isinstance(snap, Snapshot):
            return
        for r in snap.requests:
            self._names[r.ref] = r.request_id
            self.ids.add(r.request_id)
            self._counts[r.ref] = r.num_preemptions

    def take(self, d: Digested) -> bool:
        """Count step `d`, decoded by another walk of the same trace, when it is the next
        step this scan would read (whether it was): a live view that decodes every step
        for its log need not have it decoded twice."""
        if not self._next(d) or self._steps == 0:
            return False  # not next; or a mid-run trace's snapshot may lie before it
        self._taken(d)
        rec = d.rec
        self._count(
            rec.step,
            rec.arrivals,
            rec.admissions,
            rec.free_blocks_after_schedule,
            rec.preemptions,
            rec.finishes,
            rec.num_decodes + sum(e.num_tokens for e in rec.scheduled),
            rec.free_blocks,
        )
        return True

    def _step(self, body: object) -> None:
        if type(body) is not dict:
            raise Bad("expected a map")
        # Each field decoded in the order the counting reads it (a bad one is reported
        # as before: by name, the first that fails).
        step = _get(body, "step")
        arrivals: tuple[Arrival, ...] = _get(body, "arrivals")
        admissions: tuple[Admission, ...] = _get(body, "admissions")
        free_after = _get(body, "free_blocks_after_schedule")
        preemptions: tuple[Preemption, ...] = _get(body, "preemptions")
        finishes: tuple[Finish, ...] = _get(body, "finishes")
        scheduled: tuple[Scheduled, ...] = _get(body, "scheduled")
        computed = _get(body, "num_decodes") + sum(e.num_tokens for e in scheduled)
        self._count(
            step,
            arrivals,
            admissions,
            free_after,
            preemptions,
            finishes,
            computed,
            _get(body, "free_blocks"),
        )

    def _count(
        self,
        step: int,
        arrivals: tuple[Arrival, ...],
        admissions: tuple[Admission, ...],
        free_after: int,
        preemptions: tuple[Preemption, ...],
        finishes: tuple[Finish, ...],
        computed: int,
        free: int,
    ) -> None:
        for a in arrivals:
            self._names[a.ref] = a.request_id
            self.ids.add(a.request_id)
        for ad in admissions:
            self._back_in[ad.ref] = step
        for p in preemptions:
            self._preempt(step, p, free_after)
        for f in finishes:
            self._finish(step, f, free_after)
        self._computed += computed
        self._free = free
        self._steps += 1
        self.last_step = step

    def _name(self, ref: int) -> str:
        return self._names.get(ref, f"#{ref}")

    def _preempt(self, step: int, p: Preemption, free_after: int) -> None:
        count = self._counts.get(p.victim, 0) + 1
        self._counts[p.victim] = count
        victim = self._name(p.victim)
        flags = []
        if count >= REPEAT:
            flags.append(_ordinal(count) + " time")
        back_in = self._back_in.get(p.victim)
        if count > 1 and back_in is not None and step - back_in <= THRASH_STEPS:
            d = step - back_in
            flags.append(f"{d} step{'' if d == 1 else 's'} after resuming")
        self._thrash += bool(flags)
        self._victims[victim] += 1
        self._lost += p.tokens_lost
        cause = "itself" if p.victim == p.for_request else self._name(p.for_request)
        self.incidents.append(
            Incident(
                step,
                IncidentKind.PREEMPT,
                victim,
                cause,
                p.tokens_lost,
                self._free,
                free_after,
                count,
                "; ".join(flags),
            )
        )

    def _finish(self, step: int, f: Finish, free_after: int) -> None:
        name = self._name(f.ref)
        if f.status in (Status.FINISHED_ABORTED, Status.FINISHED_ERROR):
            error = f.status == Status.FINISHED_ERROR
            self._errors += error
            self._aborts += not error
            self.incidents.append(
                Incident(
                    step,
                    IncidentKind.ERROR if error else IncidentKind.ABORT,
                    name,
                    f.message or ("error" if error else "aborted by the client"),
                    0,
                    self._free,
                    free_after,
                    self._counts.get(f.ref, 0),
                    "",
                )
            )
        self._names.pop(f.ref, None)
        self._counts.pop(f.ref, None)
        self._back_in.pop(f.ref, None)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _get(body: dict[Any, Any], name: str) -> Any:
    """One field of a step record's body, decoded (its default when it is left out)."""
    key, codec = _CODECS[name]
    value = body.get(key)
    if value is None:
        if name not in STEP_DEFAULTS:
            raise Bad(f"required field {name} (key {key}) is missing")
        return STEP_DEFAULTS[name]
    try:
        return codec.dec(value)
    except Bad as e:
        e.path.append(name)
        raise


STEP_DEFAULTS: dict[str, Any] = {
    "arrivals": (),
    "admissions": (),
    "preemptions": (),
    "finishes": (),
    "scheduled": (),
    "num_decodes": 0,
    "free_blocks_after_schedule": 0,
    "free_blocks": 0,
}


def scan(path: str) -> IncidentScan:
    """Every incident of the trace at `path` (its readable part, if it was cut)."""
    reader = open_trace(path)
    try:
        s = IncidentScan(reader)
        s.advance()
        return s
    finally:
        reader.close()


def unknown_requests(path: str, request_ids: Iterable[str]) -> list[str]:
    """The ids among `request_ids` that no request of the trace at `path` has."""
    wanted = list(dict.fromkeys(request_ids))
    if not wanted:
        return []
    ids = scan(path).ids
    known = ids | {client_id(i) for i in ids}  # a client id names its request too
    return [r for r in wanted if r not in known]


# -- what a view shows of them -------------------------------------------------------------


SORTS = ("step", "request", "lost", "free", "count")


_SORT_FIELDS = {
    "step": "step",
    "request": "request_id",
    "lost": "tokens_lost",
    "free": "free_before",
    "count": "count",
}


def select(
    incidents: Sequence[Incident],
    kinds: Iterable[IncidentKind] = (IncidentKind.PREEMPT,),
    query: str = "",
    sort: str = "step",
    reverse: bool = False,
) -> tuple[Incident, ...]:
    """The incidents a view lists: of `kinds`, matching every word of `query` (in the
    request id, the cause or the thrash note; `thrash` matches the flagged ones), sorted
    by `sort`."""
    wanted = set(kinds)
    words = query.lower().split()
    out = [i for i in incidents if i.kind in wanted]
    if words:
        out = [i for i in out if all(_matches(i, w) for w in words)]
    if sort != "step" or reverse:
        # One attribute per key: the sort is stable, so ties stay in step order.
        out.sort(key=attrgetter(_SORT_FIELDS[sort]), reverse=reverse)
    return tuple(out)


def _matches(i: Incident, word: str) -> bool:
    if word == "thrash":
        return bool(i.thrash)
    return word in i.request_id.lower() or word in i.cause.lower() or word in i.thrash


def format_summary(s: StormSummary) -> str:
    """The storm summary lines of `schedtop stats`."""
    top = ", ".join(f"{rid} ×{n}" for rid, n in s.top_victims) or "-"
    rows = [
        ("preempt per 1k", f"{s.per_1k_steps:.1f} ({s.preemptions} in {s.steps} steps)"),
        (
            "recompute lost",
            f"{s.lost_share:.1%} of computed tokens ({s.tokens_lost} of {s.computed_tokens})",
        ),
        ("thrash", f"{s.thrash} preemptions (again within {THRASH_STEPS} steps, or {REPEAT}+)"),
        ("top victims", top),
        ("aborts / errors", f"{s.aborts} / {s.errors}"),
    ]
    return "\n".join(f"{k:<15}  {v}" for k, v in rows)
