"""Per-step digests: the few numbers and events the sparklines and the event log need,
kept for a bounded number of recent steps.

A digest needs the state before its step (to name the requests the step mentions) and
after it (queue lengths), so digests are made by walking the Timeline step by step; the
walk is the same work as stepping, and a window of them is cached so that moving the
cursor by one step makes one new digest. `History` is bounded: memory stays flat however
long a trace is or however fast a live engine writes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from recorder.schema import STATUS_LABELS, KVEvents, KVKind, Status, Step
from replays.state import State
from replays.timeline import Timeline
from tui.waits import decoders, unscheduled

_FINISH_WORDS = STATUS_LABELS
_LISTED = 4  # events of one kind in one step listed one by one; more are summarised


# Event and Digest are not frozen: a live view makes one Digest and a few Events for
# every step an engine writes, thousands a second, and a frozen dataclass's __init__
# (object.__setattr__ per field) costs several times a plain one's. Never changed once
# built, as engine.records.Step, so they hash by value as frozen ones would.
@dataclass(slots=True, unsafe_hash=True)
class Event:
    """One line of the event log."""

    step: int  # the step it happened in
    kind: str  # arrive, admit, evict, preempt, finish, abort (aborted or error), break, note
    text: str  # what happened, in words
    requests: tuple[str, ...] = ()  # the ids of the requests it is about


@dataclass(slots=True, unsafe_hash=True)  # not frozen (above)
class Digest:
    """One step, reduced to what the sparklines and the event log show."""

    step: int  # the step
    time_ns: int  # when it ended, ns since recording started
    step_ns: int  # how long it took: since the previous step ended (0 for the first)
    running: int  # running requests after it
    waiting: int  # waiting requests after it
    free_blocks: int  # free KV blocks after it
    preemptions: int  # preemptions in it
    scheduled_tokens: int  # tokens scheduled in it
    events: tuple[Event, ...]  # what happened in it
    unscheduled: tuple[tuple[int, int], ...] = ()  # (ref, Reason) of requests it left out
    # the prefix cache at first admissions (vLLM's hit rate counts those): tokens found
    # cached, and tokens looked up; and cached blocks evicted to make room
    hit_tokens: int = 0
    query_tokens: int = 0
    evicted: int = 0


def digest(
    rec: Step,
    names: Mapping[int, str],
    after: State,
    prev_time_ns: int | None,
    engine_time: bool = False,
    leading: tuple[int, ...] | None = None,
    prefix_caching: bool = False,
    cached_by: Mapping[int, str] | None = None,
    evictions: list[tuple[tuple[int, ...], int | None]] | None = None,
) -> Digest:
    """The digest of step `rec`: `names` gives the ids of the requests it mentions that
    were there before it (arrivals name themselves), `after` is the state after it.
    `engine_time`: the step's time is the engine's own (schedule + update), not the
    time since the step before (a simulated run's clock includes its pacing sleep).
    `leading`: the step's leading decodes (tui.waits.decoders), for wait accounting.
    `prefix_caching`: the run caches prefixes, so an admission with no hit is a miss.
    `cached_by`: block id -> the request that filled it last (History keeps it).
    `evictions`: _evictions(rec), when the caller has them already."""
    if not (
        rec.arrivals
        or rec.admissions
        or rec.preemptions
        or rec.finishes
        or rec.scheduled
        or rec.evicted_slots
    ):
        return _decodes_only(
            rec, names, after, prev_time_ns, engine_time, leading, cached_by, evictions
        )
    return digest_any(
        rec, names, after, prev_time_ns, engine_time, leading, prefix_caching, cached_by, evictions
    )


def digest_any(
    rec: Step,
    names: Mapping[int, str],
    after: State,
    prev_time_ns: int | None,
    engine_time: bool = False,
    leading: tuple[int, ...] | None = None,
    prefix_caching: bool = False,
    cached_by: Mapping[int, str] | None = None,
    evictions: list[tuple[tuple[int, ...], int | None]] | None = None,
) -> Digest:
    """digest() of any step, by the general passes (tests check the decodes-only lane
    against it)."""
    arrived = {a.ref: a.request_id for a in rec.arrivals} if rec.arrivals else {}

    def name(ref: int) -> str:
        return names.get(ref) or arrived.get(ref, f"#{ref}")

    # the step's work, not the wait before it (Step.duration_ns; docs/metrics.md)
    step_ns = rec.work_ns if prev_time_ns is None else rec.duration_ns(prev_time_ns)
    if engine_time:
        step_ns = rec.schedule_ns + rec.update_ns
    lookups = _lookups(rec, after) if rec.admissions else {}
    hits = queries = 0
    for a in rec.admissions:
        if not a.resumed:
            hits += a.cached_tokens
            queries += lookups.get(a.ref, a.cached_tokens)
    if evictions is None:
        evictions = _evictions(rec)
    if rec.arrivals or rec.admissions or rec.preemptions or rec.finishes or rec.evicted_slots:
        events = tuple(
            step_events(rec, name, lookups if prefix_caching else None, cached_by, evictions)
        )
    else:
        # Most steps of a busy engine: decodes, and at most a block or two evicted. A
        # live view digests every one of thousands a second, so the other kinds' empty
        # passes are not made.
        events = tuple(_evicted(rec.step, evictions, name, cached_by)) if evictions else ()
    scheduled = rec.num_scheduled_tokens if rec.scheduled else rec.num_decodes
    return Digest(
        rec.step,
        rec.time_ns,
        step_ns,
        len(after.running),
        len(after.waiting),
        rec.free_blocks,
        len(rec.preemptions),
        scheduled,
        events,
        () if leading is None else unscheduled(rec, leading, after),
        hits,
        queries,
        # a token pool's (format 1.8) are slots, which are its blocks (block_size 1)
        (sum([len(blocks) for blocks, _ in evictions]) if evictions else 0) + rec.evicted_slots,
    )


def _decodes_only(
    rec: Step,
    names: Mapping[int, str],
    after: State,
    prev_time_ns: int | None,
    engine_time: bool,
    leading: tuple[int, ...] | None,
    cached_by: Mapping[int, str] | None,
    evictions: list[tuple[tuple[int, ...], int | None]] | None,
) -> Digest:
    """digest() of a step that admits, preempts, schedules and finishes nothing (no
    arrival either): its decodes and evictions are all it has (most steps of a busy
    engine, which a live view digests thousands of a second). The same Digest, without
    the other kinds' empty passes."""
    if evictions is None:
        evictions = _evictions(rec)
    if evictions:

        def name(ref: int) -> str:
            return names.get(ref) or f"#{ref}"

        events = tuple(_evicted(rec.step, evictions, name, cached_by))
        evicted = sum([len(blocks) for blocks, _ in evictions])
    else:
        events, evicted = (), 0
    if leading is None:
        left: tuple[tuple[int, int], ...] = ()
    elif len(leading) == len(after.requests):
        # every request was scheduled: the leading decodes are distinct requests that
        # are all still there (nothing finished), so counting them is the set test
        left = ()
    else:
        left = unscheduled(rec, leading, after)
    if engine_time:
        step_ns = rec.schedule_ns + rec.update_ns
    else:
        work = rec.work_ns
        step_ns = work if prev_time_ns is None or work else max(0, rec.time_ns - prev_time_ns)
    return Digest(
        rec.step,
        rec.time_ns,
        step_ns,
        len(after.running),
        len(after.waiting),
        rec.free_blocks,
        0,
        rec.num_decodes,
        events,
        left,
        0,
        0,
        evicted,
    )


def _lookups(rec: Step, after: State) -> dict[int, int]:
    """The tokens each first admission of the step looked up in the prefix cache: its
    prompt (from its arrival, or the state after the step; a request that finished in
    the step and arrived before it is not known)."""
    prompts = {a.ref: a.num_prompt_tokens for a in rec.arrivals}
    reqs = after.requests
    out: dict[int, int] = {}
    for a in rec.admissions:
        if a.resumed:
            continue
        n = prompts.get(a.ref)
        if n is None and a.ref in reqs:
            n = reqs[a.ref].num_prompt_tokens
        if n is not None:
            out[a.ref] = n
    return out


_CACHED, _EVICTED = KVKind.CACHED, KVKind.EVICTED


def _cached(kv: KVEvents) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(ref, blocks) of each CACHED event, read off the columns (rows() spells out every
    event; a decode step's are mostly allocations)."""
    refs = iter(kv.refs)
    at = 0
    ids = kv.block_ids
    for kind, size in zip(kv.kinds, kv.sizes):
        if kind != _EVICTED:
            ref = next(refs)
            if kind == _CACHED:
                yield ref, ids[at : at + size]
        at += size


def _evictions(rec: Step) -> list[tuple[tuple[int, ...], int | None]]:
    """(blocks, ref) per run of evictions: the cached blocks the step handed out again,
    and the request whose allocation took them (the next KV event's). Read off the
    columns, as _cached does: with prefix caching most decode steps evict, and a live
    view digests thousands of steps a second."""
    kv = rec.kv_events
    kinds = kv.kinds
    if _EVICTED not in kinds:
        return []
    out: list[tuple[tuple[int, ...], int | None]] = []
    pending: list[int] = []
    ids, refs = kv.block_ids, kv.refs
    at = owner = 0
    for kind, size in zip(kinds, kv.sizes):
        if kind == _EVICTED:
            pending += ids[at : at + size]
        else:
            if pending:
                out.append((tuple(pending), refs[owner]))
                pending = []
            owner += 1  # every other kind names its request
        at += size
    if pending:
        out.append((tuple(pending), None))
    return out


def _whose(
    blocks: tuple[int, ...], cached_by: Mapping[int, str] | None
) -> tuple[str, tuple[str, ...]]:
    """(" (12 of t00, 3 of t01)", their ids): whose cached blocks they were, where known."""
    if not cached_by:
        return "", ()
    if len(blocks) == 1:  # the usual eviction: one block, for one decode's allocation
        who = cached_by.get(blocks[0])
        return ("", ()) if who is None else (f" (1 of {who})", (who,))
    counts: dict[str, int] = {}
    for b in blocks:
        who = cached_by.get(b)
        if who is not None:
            counts[who] = counts.get(who, 0) + 1
    if not counts:
        return "", ()
    most = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    parts = [f"{n} of {who}" for who, n in most]
    more = ", ..." if len(counts) > 3 else ""
    return " (" + ", ".join(parts) + more + ")", tuple(who for who, _ in most)


def step_events(
    rec: Step,
    name: Callable[[int], str],
    lookups: dict[int, int] | None = None,
    cached_by: Mapping[int, str] | None = None,
    evictions: list[tuple[tuple[int, ...], int | None]] | None = None,
) -> Iterable[Event]:
    """The event lines of one step: arrivals, admissions (with their prefix-cache hit or
    miss when `lookups` gives the tokens looked up), evictions of cached blocks (whose
    they were, by block, where `cached_by` knows), preemptions, finishes."""
    s = rec.step
    arrivals = [
        (
            a.request_id,
            f"{a.request_id} arrived: {a.num_prompt_tokens} prompt tokens"
            + (f", priority {a.priority}" if a.priority else ""),
        )
        for a in rec.arrivals
    ]
    yield from _listed(s, "arrive", arrivals, "arrived")
    admits = []
    for a in rec.admissions:
        rid = name(a.ref)
        verb = "resumed" if a.resumed else "admitted"
        looked = None if lookups is None or a.resumed else lookups.get(a.ref)
        if looked is not None and a.cached_tokens:
            cache = f": prefix hit, {a.cached_tokens} of {looked} tokens cached"
        elif looked is not None:
            cache = f": prefix miss, {looked} tokens to compute"
        else:
            cache = f", {a.cached_tokens} tokens cached" if a.cached_tokens else ""
        admits.append((rid, f"{rid} {verb}{cache}"))
    yield from _listed(s, "admit", admits, "admitted")
    yield from _evicted(s, _evictions(rec) if evictions is None else evictions, name, cached_by)
    if rec.evicted_slots:
        # a token pool (SGLang, format 1.8) counts its evictions without naming slots, and
        # its radix cache evicts for the batch, not for one request
        n = rec.evicted_slots
        yield Event(s, "evict", f"{n} cached {'slot' if n == 1 else 'slots'} evicted")
    for p in rec.preemptions:
        victim, cause = name(p.victim), name(p.for_request)
        why = (
            "no KV room for itself"
            if p.victim == p.for_request
            else f"for {cause}, which needed KV blocks"
        )
        yield Event(
            s,
            "preempt",
            f"{victim} preempted {why}: {p.tokens_lost} tokens lost",
            (victim,) if p.victim == p.for_request else (victim, cause),
        )
    finishes: list[tuple[str, str]] = []
    aborts: list[
        tuple[str, str]
    ] = []  # aborted or failed: their own kind, so that the log can show them alone
    for f in rec.finishes:
        rid = name(f.ref)
        how = _FINISH_WORDS.get(f.status, "finished")
        text = f"{rid} finished: {how}" + (f" ({f.message})" if f.message else "")
        bad = f.status in (Status.FINISHED_ABORTED, Status.FINISHED_ERROR)
        (aborts if bad else finishes).append((rid, text))
    yield from _listed(s, "finish", finishes, "finished")
    yield from _listed(s, "abort", aborts, "aborted or failed")


def _evicted(
    s: int,
    evictions: list[tuple[tuple[int, ...], int | None]],
    name: Callable[[int], str],
    cached_by: Mapping[int, str] | None,
) -> Iterable[Event]:
    """The event lines of a step's evictions of cached blocks (_evictions)."""
    for blocks, ref in evictions:
        who = name(ref) if ref is not None else ""
        n = len(blocks)
        whose, owners = _whose(blocks, cached_by)
        yield Event(
            s,
            "evict",
            f"{n} cached {'block' if n == 1 else 'blocks'} evicted{whose}"
            + (f" for {who}" if who else ""),
            (*((who,) if who else ()), *owners),
        )


def _listed(step: int, kind: str, items: list[tuple[str, str]], verb: str) -> Iterable[Event]:
    """One event per item, or, for many, the first few and one summary line."""
    if len(items) <= _LISTED + 1:
        for rid, text in items:
            yield Event(step, kind, text, (rid,))
        return
    for rid, text in items[:_LISTED]:
        yield Event(step, kind, text, (rid,))
    rest = [rid for rid, _ in items[_LISTED:]]
    shown = ", ".join(rest[:3]) + (", ..." if len(rest) > 3 else "")
    yield Event(step, kind, f"{len(rest)} more {verb}: {shown}", tuple(rest))


# Told of each step a History digests: (its record, its digest, the state after it; the
# state is the Timeline's working one: read it during the call, don't keep it).
Seen = Callable[[Step, Digest, State], None]


class History:
    """The digests of recently visited steps, at most `capacity` of them (least recently
    used go first)."""

    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.engine_time = False  # step times are the engine's own (simulated runs)
        self.made = 0  # digests made so far, all told (benchmarks count the work with it)
        self.prefix_caching = False  # the run caches prefixes: a first admission may miss
        # block id -> the request that filled it last, over consecutive digested steps
        # up to _cached_step (a gap or a step back starts it again: it would lie)
        self._cached_by: dict[int, str] = {}
        self._cached_step: int | None = None
        self._digests: OrderedDict[int, Digest] = OrderedDict()

    def __len__(self) -> int:
        return len(self._digests)

    def get(self, step: int) -> Digest | None:
        return self._digests.get(step)

    def missing(self, lo: int, hi: int) -> int:
        """How many of steps lo..hi have no digest."""
        got = self._digests
        return sum(1 for s in range(lo, hi + 1) if s not in got)

    def window(self, lo: int, hi: int) -> tuple[Digest, ...]:
        """The cached digests of steps lo..hi, in order (fill() them first)."""
        got = self._digests
        out: list[Digest] = []
        for s in range(lo, hi + 1):
            d = got.get(s)
            if d is not None:
                got.move_to_end(s)
                out.append(d)
        return tuple(out)

    def recent(self, step: int, limit: int) -> tuple[Digest, ...]:
        """Up to `limit` cached digests of consecutive steps ending at `step`, in order."""
        out: list[Digest] = []
        s = step
        while len(out) < limit and (d := self._digests.get(s)) is not None:
            out.append(d)
            s -= 1
        return tuple(reversed(out))

    def fill(
        self,
        timeline: Timeline,
        lo: int,
        hi: int,
        seen: Seen | None = None,
        keyframes_from: int | None = None,
    ) -> int:
        """Make the missing digests of steps lo..hi (clamped to the trace), walking the
        timeline. Returns how many it made. Moves the timeline's working state.
        `seen(record, digest, state after)` is called for each step digested, in order.
        `keyframes_from`: the Timeline keeps no keyframes of the steps before it (a live
        batch of hundreds of steps would copy the state every few dozen for nothing)."""
        lo, hi = max(lo, timeline.first_step), min(hi, timeline.last_step)
        if hi - lo + 1 > self.capacity:
            lo = hi - self.capacity + 1
        made = 0
        s = lo
        while s <= hi:
            if s in self._digests:
                s += 1
                continue
            made += self._walk(timeline, s, hi, seen, keyframes_from)
            s += 1
            while s <= hi and s not in self._digests:
                s += 1
        return made

    def _walk(
        self,
        timeline: Timeline,
        start: int,
        hi: int,
        seen: Seen | None,
        keyframes_from: int | None,
    ) -> int:
        """Digest the run of missing steps that starts at `start`."""
        made = 0
        prev_time = self._time_before(timeline, start)
        end = start
        while end < hi and end + 1 not in self._digests:
            end += 1
        timeline.read_ahead(start, end)
        digests, capacity = self._digests, self.capacity
        for s in range(start, end + 1):
            before = timeline.state(s - 1)
            rec = timeline.record(s)
            evictions = _evictions(rec)  # once: the names and the digest both need them
            names = names_before(rec, before, evictions)  # now: state(s) moves `before` on
            leading = decoders(rec, before)
            after = timeline.state(s, keyframes_from is None or s >= keyframes_from)
            d = self._digest(rec, names, after, prev_time, leading, evictions)
            digests[s] = d  # _put(d): a new step, so already the most recent
            if len(digests) > capacity:
                digests.popitem(last=False)
            if seen is not None:
                seen(rec, d, after)
            self.made += 1
            prev_time = d.time_ns
            made += 1
        return made

    def add_step(
        self,
        timeline: Timeline,
        step: int,
        names: Mapping[int, str],
        leading: tuple[int, ...] | None = None,
        seen: Seen | None = None,
    ) -> None:
        """Digest `step` from the state after it (the timeline's working state there) and
        the names and leading decodes taken before it (names_before, decoders), if it is
        not digested yet."""
        if step in self._digests:
            return
        prev_time = self._time_before(timeline, step)
        rec = timeline.record(step)
        after = timeline.state(step)
        d = self._digest(rec, names, after, prev_time, leading)
        self._put(d)
        if seen is not None:
            seen(rec, d, after)

    def _time_before(self, timeline: Timeline, step: int) -> int:
        """When the step before `step` ended (its digest's, else the trace's); the first
        step's time counts from the start of the recording."""
        prev = self._digests.get(step - 1)
        if prev is not None:
            return prev.time_ns
        return timeline.time_ns(step - 1) if step > timeline.first_step else 0

    def _digest(
        self,
        rec: Step,
        names: Mapping[int, str],
        after: State,
        prev_time: int | None,
        leading: tuple[int, ...] | None,
        evictions: list[tuple[tuple[int, ...], int | None]] | None = None,
    ) -> Digest:
        """digest(), with whose blocks evictions take, as far as the steps digested one
        after another tell."""
        known = self._cached_by
        if self._cached_step != rec.step - 1:
            known.clear()
        d = digest(
            rec,
            names,
            after,
            prev_time,
            self.engine_time,
            leading,
            self.prefix_caching,
            known,
            evictions,
        )
        kv = rec.kv_events
        if _CACHED in kv.kinds:
            reqs = after.requests
            for ref, blocks in _cached(kv):
                # a request that filled a block is running, so still there after the
                # step, unless it finished in it (then the step names it)
                r = reqs.get(ref)
                who = r.request_id if r is not None else names.get(ref)
                if who is not None:
                    for b in blocks:
                        known[b] = who
        self._cached_step = rec.step
        return d

    def _put(self, d: Digest) -> None:
        self.made += 1
        self._digests[d.step] = d
        self._digests.move_to_end(d.step)
        while len(self._digests) > self.capacity:
            self._digests.popitem(last=False)


def names_before(
    rec: Step,
    before: State,
    evictions: list[tuple[tuple[int, ...], int | None]] | None = None,
) -> dict[int, str]:
    """The ids of the requests step `rec` mentions, from the state before it (take them
    before the Timeline moves that state on). `evictions`: _evictions(rec), if made."""
    reqs = before.requests
    if evictions is not None and not (rec.admissions or rec.preemptions or rec.finishes):
        # a decode step's: only the requests whose allocations evicted cached blocks
        return {ref: reqs[ref].request_id for _, ref in evictions if ref in reqs}
    return {ref: reqs[ref].request_id for ref in _mentioned(rec, evictions) if ref in reqs}


def _mentioned(
    rec: Step, evictions: list[tuple[tuple[int, ...], int | None]] | None
) -> Iterable[int]:
    for a in rec.admissions:
        yield a.ref
    # whose allocation evicted cached blocks
    for _, ref in _evictions(rec) if evictions is None else evictions:
        if ref is not None:
            yield ref
    for p in rec.preemptions:
        yield p.victim
        yield p.for_request
    for f in rec.finishes:
        yield f.ref
