"""The reducer: the state after step i is the state after step i-1 with step record i
applied (docs/contracts.md R1). Pure data in, pure data out: no engine, no file.

    state = State.initial(header)            # or State.from_snapshot(header, snapshot)
    for step in steps:
        apply(state, step)                    # in place; reduce(state, step) copies first
        view = apply_with_view(state, step)   # the same, plus the step spelled out

Applying a step replays its KV events with the block pool's exact rules (docs/contracts.md K5):
allocation takes blocks from the free-queue head; freeing walks the table tail-first,
putting unhashed blocks at the head (in that order) and hashed ones at the tail; a prefix
hit on a free block takes it out of the queue; eviction drops the hash. Every record is
checked against the state it lands on; a mismatch raises Inconsistent (a TraceError), and
the state is then undefined (apply to a copy to keep the original).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import cast

from recorder.derive import (
    leading_decodes,
    running_after,
    waiting_after_fcfs,
    waiting_after_priority,
)
from recorder.errors import TraceError
from recorder.reader import Entry, TraceReader
from recorder.schema import (
    Arrival,
    Header,
    Kind,
    KVEvent,
    KVKind,
    RequestState,
    Sample,
    Scheduled,
    Snapshot,
    Status,
    Step,
)
from replays.slots import SlotPool, SlotsInconsistent
from replays.state import Inconsistent, State

_ERRORS = (KeyError, IndexError, ValueError, TypeError, OverflowError)
# Enum members looked up once: a class attribute lookup on an enum costs ~200 ns, and the
# KV loop makes several per event.
_ALLOCATED, _FREED, _CACHED, _EVICTED = (
    KVKind.ALLOCATED,
    KVKind.FREED,
    KVKind.CACHED,
    KVKind.EVICTED,
)


@dataclass(frozen=True, slots=True)
class StepView:
    """One step spelled out: what the record leaves implicit, made explicit."""

    record: Step  # the record itself
    scheduled: tuple[Scheduled, ...]  # every scheduled entry, the leading decodes included
    samples: tuple[Sample, ...]  # per request that sampled, in scheduled order
    kv_events: tuple[KVEvent, ...]  # as recorded, with EVICTED hashes filled in
    names: dict[int, str]  # ref -> request id for every request the step mentions


def apply(state: State, step: Step, offset: int | None = None) -> None:
    """Apply one step record to `state` in place. `offset` goes into errors."""
    _guarded(state, step, offset, False)


def apply_with_view(state: State, step: Step, offset: int | None = None) -> StepView:
    """apply(), returning the step spelled out."""
    view = _guarded(state, step, offset, True)
    assert view is not None
    return view


def reduce(state: State, step: Step) -> State:
    """A new state: `state` with `step` applied (`state` is left as it was)."""
    after = state.copy()
    apply(after, step)
    return after


def replay(header: Header, entries: Iterable[Entry], state: State | None = None) -> Iterator[State]:
    """The state after each step record of `entries` (as TraceReader.entries() yields
    them), the same object updated in place. Snapshots along the way start the state or
    are checked against it; other records are skipped."""
    for entry in entries:
        record = entry.record
        if isinstance(record, Snapshot):
            if state is None:
                state = State.from_snapshot(header, record)
            elif state.to_snapshot() != record:
                raise Inconsistent(
                    f"the snapshot after step {record.step} differs from the "
                    "state the steps before it built",
                    entry.offset,
                )
        elif isinstance(record, Step):
            state = state if state is not None else State.initial(header)
            apply(state, record, entry.offset)
            yield state


def state_at(reader: TraceReader, step: int) -> State:
    """The state after `step`: the nearest snapshot, then the steps after it."""
    seek = reader.seek(step)
    state = (
        State.initial(reader.header)
        if seek.snapshot is None
        else State.from_snapshot(reader.header, seek.snapshot)
    )
    for entry in seek.steps:  # step records only, in order (the reader checked)
        apply(state, cast(Step, entry.record), entry.offset)
    return state


def _guarded(state: State, step: Step, offset: int | None, view: bool) -> StepView | None:
    try:
        return _Apply(state, step, view).run()
    except TraceError as e:
        if e.offset is None:
            e.offset = offset
        raise
    except _ERRORS as e:
        raise Inconsistent(
            f"step {step.step} does not fit the state before it: {type(e).__name__}: {e}", offset
        ) from None


class _Apply:
    """One application of one step record (a class only to share its locals)."""

    def __init__(self, state: State, step: Step, view: bool) -> None:
        self.s = state
        self.rec = step
        self.view = view
        self.kv_view: list[KVEvent] = []
        self.names: dict[int, str] = {}

    def run(self) -> StepView | None:
        s, rec = self.s, self.rec
        if rec.step != s.step + 1:
            raise Inconsistent(f"step {rec.step} applied after step {s.step}")
        if not self.view and _steady(rec):
            self._steady()
            return None
        self._arrivals()
        try:
            decoders = leading_decodes(
                self._running_at_schedule(), rec.num_decodes, rec.decode_skips
            )
        except ValueError as e:
            raise Inconsistent(str(e)) from None
        if self.view:
            self._name_all(decoders)
        self._kv_events()
        self._admissions()
        self._preemptions()
        if s.slots is not None:
            self._slots(s.slots, decoders)
        entries = self._scheduled(decoders)
        samples = self._samples(decoders)
        self._finishes()
        self._queues()
        if s.slots is not None:
            self._slots_checked(s.slots)
        if len(s.free) != rec.free_blocks:
            raise Inconsistent(f"{len(s.free)} free blocks, the record says {rec.free_blocks}")
        s.step = rec.step
        if not self.view:
            return None
        return StepView(rec, entries, samples, tuple(self.kv_view), self.names)

    def _steady(self) -> None:
        """run() for a step in which the leading decodes are all that is scheduled, one
        token each, and no request arrives, moves between queues or finishes (_steady):
        most steps of a busy engine, which a live view applies thousands of a second.
        The same checks and the same state as the general path, without its passes over
        what the record does not hold."""
        s, rec = self.s, self.rec
        try:
            decoders = leading_decodes(s.running, rec.num_decodes, ())
        except ValueError as e:
            raise Inconsistent(str(e)) from None
        self._kv_events()
        reqs = s.requests
        for ref in decoders:
            r = reqs[ref]
            r.num_computed_tokens += 1
            r.num_output_tokens += 1  # a decode follows a sample: never the first
        tokens = rec.sampled_tokens
        if tokens is not None and len(tokens) != len(decoders):
            raise Inconsistent(f"{len(tokens)} sampled tokens, the counts say {len(decoders)}")
        if len(s.free) != rec.free_blocks:
            raise Inconsistent(f"{len(s.free)} free blocks, the record says {rec.free_blocks}")
        s.step = rec.step

    # -- requests --------------------------------------------------------------------------

    def _arrivals(self) -> None:
        s, step = self.s, self.rec.step
        for a in self.rec.arrivals:
            if a.ref != s.next_ref:
                raise Inconsistent(f"arrival with ref {a.ref}, expected {s.next_ref}")
            s.next_ref += 1
            s.requests[a.ref] = arrived(a, step)

    def _name_all(self, decoders: list[int]) -> None:
        rec, reqs, names = self.rec, self.s.requests, self.names
        refs = [
            *(f.ref for f in rec.finishes),
            *(a.ref for a in rec.admissions),
            *(p.victim for p in rec.preemptions),
            *(s.ref for s in rec.scheduled),
            *rec.kv_events.refs,
            *(x.ref for x in rec.other_samples),
            *decoders,
        ]
        for ref in refs:
            names[ref] = reqs[ref].request_id

    def _running_at_schedule(self) -> list[int]:
        """Running as schedule() found it: aborts between steps had removed requests."""
        aborted = {f.ref for f in self.rec.finishes if f.status == Status.FINISHED_ABORTED}
        running = self.s.running
        return [r for r in running if r not in aborted] if aborted else running

    def _admissions(self) -> None:
        reqs, step = self.s.requests, self.rec.step
        for a in self.rec.admissions:
            r = reqs[a.ref]
            r.status = Status.RUNNING
            r.num_computed_tokens = a.cached_tokens
            if r.num_cached_tokens < 0:
                r.num_cached_tokens = a.cached_tokens
            if r.first_scheduled_step < 0:
                r.first_scheduled_step = step

    def _preemptions(self) -> None:
        reqs = self.s.requests
        for p in self.rec.preemptions:
            r = reqs[p.victim]
            r.status = Status.PREEMPTED
            r.num_computed_tokens = 0
            r.num_preemptions += 1

    def _scheduled(self, decoders: list[int]) -> tuple[Scheduled, ...]:
        """Advance num_computed_tokens; the entries in full when a view is wanted. The
        leading decodes compute one token each and, unless the record says otherwise,
        sample one: both are counted in the one loop that 256 decodes make hot."""
        rec, reqs = self.rec, self.s.requests
        entries: tuple[Scheduled, ...] = ()
        if self.view:
            entries = (
                *(
                    Scheduled(ref, 1, Kind.DECODE, reqs[ref].num_computed_tokens)
                    for ref in decoders
                ),
                *rec.scheduled,
            )
        if rec.sample_counts is None:
            for ref in decoders:
                r = reqs[ref]
                r.num_computed_tokens += 1
                r.num_output_tokens += 1  # a decode follows a sample: never the first
        else:
            for ref in decoders:
                reqs[ref].num_computed_tokens += 1
        for e in rec.scheduled:
            reqs[e.ref].num_computed_tokens = e.num_computed_before + e.num_tokens
        if rec.spec_accepted:
            spec = {e.ref: e.num_spec_tokens for e in rec.scheduled}
            for a in rec.spec_accepted:
                reqs[a.ref].num_computed_tokens -= spec.get(a.ref, 0) - a.accepted
        return entries

    def _samples(self, decoders: list[int]) -> tuple[Sample, ...]:
        """Count the sampled tokens (the leading decodes' single ones are counted already
        when the record has no sample_counts)."""
        rec, reqs, step = self.rec, self.s.requests, self.rec.step
        num_entries = len(decoders) + len(rec.scheduled)
        counts = rec.sample_counts
        if counts is not None and len(counts) != num_entries:
            raise Inconsistent(f"{len(counts)} sample counts for {num_entries} entries")
        tokens = rec.sampled_tokens
        total = num_entries if counts is None else sum(counts)
        if tokens is not None and len(tokens) != total:
            raise Inconsistent(f"{len(tokens)} sampled tokens, the counts say {total}")
        if counts is None:  # the leading decodes' are counted: the rest sample one each
            for e in rec.scheduled:
                _sampled(reqs[e.ref], 1, step)
        else:
            for ref, count in zip([*decoders, *(e.ref for e in rec.scheduled)], counts):
                _sampled(reqs[ref], count, step)
        for x in rec.other_samples:
            _sampled(reqs[x.ref], x.count, step)
        if not self.view:
            return ()
        refs = [*decoders, *(e.ref for e in rec.scheduled)]
        out: list[Sample] = []
        at = 0
        for ref, count in zip(refs, repeat(1) if counts is None else counts):
            if count:
                out.append(Sample(ref, count, None if tokens is None else tokens[at : at + count]))
                at += count
        return (*out, *rec.other_samples)

    def _finishes(self) -> None:
        reqs = self.s.requests
        for f in self.rec.finishes:
            if f.status <= Status.PREEMPTED:
                raise Inconsistent(f"finish of request {f.ref} with status {f.status}")
            r = reqs.pop(f.ref)
            if r.block_ids:
                raise Inconsistent(f"request {f.ref} finished holding blocks {r.block_ids}")

    def _queues(self) -> None:
        s, rec = self.s, self.rec
        finished = {f.ref for f in rec.finishes}
        admitted = [a.ref for a in rec.admissions]
        preempted = [p.victim for p in rec.preemptions]
        arrived = [a.ref for a in rec.arrivals]
        if rec.running is not None:
            s.running = _explicit(rec.running, s, "running")
        elif admitted or preempted or finished:
            s.running = running_after(s.running, finished.union(preempted), admitted)
        if rec.waiting is not None:
            s.waiting = _explicit(rec.waiting, s, "waiting")
        elif arrived or admitted or preempted or finished:
            gone = finished.union(admitted)
            if s.policy == "priority":
                reqs = s.requests
                s.waiting = waiting_after_priority(
                    s.waiting, arrived, preempted, gone, key=lambda r: reqs[r].priority_order()
                )
            else:
                s.waiting = waiting_after_fcfs(s.waiting, arrived, preempted, gone)

    # -- a token pool slot by slot (format 1.9) ----------------------------------------------

    def _slots(self, pool: SlotPool, decoders: list[int]) -> None:
        """In the order SGLang did it: retracted rows go, the schedule's frees (evictions,
        retractions), its allocations (each entry's tokens at its positions), then the
        writes into rows and the frees after the schedule (results: releases, the radix
        cache's duplicates). Rows are SGLang's req_to_token rows: admission opens one."""
        rec, reqs = self.rec, self.s.requests
        for p in rec.preemptions:
            pool.rows.pop(p.victim, None)
        for a in rec.admissions:
            pool.rows.setdefault(a.ref, [])
        pool.release(rec.slots_freed_first)
        if rec.slot_allocs:
            slots = pool.take(rec.slot_allocs)
            want = len(decoders) + sum(e.num_tokens for e in rec.scheduled)
            if len(slots) != want:
                raise SlotsInconsistent(f"{len(slots)} slots allocated for {want} scheduled tokens")
            rows, at = pool.rows, 0
            # a decode's slot goes at the end of its row: appended, the hot case
            for ref in decoders:
                row, pos = rows[ref], reqs[ref].num_computed_tokens
                if pos == len(row):
                    row.append(slots[at])
                else:
                    pool.place(ref, pos, slots[at : at + 1])
                at += 1
            for e in rec.scheduled:
                row, pos, n = rows[e.ref], e.num_computed_before, e.num_tokens
                if n == 1 and pos == len(row):
                    row.append(slots[at])
                else:
                    pool.place(e.ref, pos, slots[at : at + n])
                at += n
        for w in rec.slot_writes:
            pool.write(w.ref, w.position, w.runs)
        pool.release(rec.slots_freed)

    def _slots_checked(self, pool: SlotPool) -> None:
        rec = self.rec
        for f in rec.finishes:
            pool.rows.pop(f.ref, None)
        pool.evictable = rec.evictable_slots
        if pool.num_free != rec.free_slots - rec.evictable_slots:
            raise SlotsInconsistent(
                f"{pool.num_free} free slots, the record says "
                f"{rec.free_slots - rec.evictable_slots} "
                f"({rec.free_slots} free or evictable, {rec.evictable_slots} evictable)"
            )

    # -- the block map ----------------------------------------------------------------------

    def _kv_events(self) -> None:
        """Walk the event columns directly: tens of events a step make this hot, and most
        move one block (a decode filling a block: evict, allocate, cache), so that case is
        handled inline."""
        s, kv = self.s, self.rec.kv_events
        reqs, refs, all_blocks, all_hashes = s.requests, kv.refs, kv.block_ids, kv.hashes
        free, ref_cnts, block_hashes, view = s.free, s.ref_cnts, s.block_hashes, self.view
        at = owner = hashed = hit = 0
        for kind, size in zip(kv.kinds, kv.sizes):
            if size == 1 and not view and kind != _FREED:
                b = all_blocks[at]
                at += 1
                if kind == _EVICTED:
                    del block_hashes[b]
                    continue
                r = reqs[refs[owner]]
                owner += 1
                if kind == _ALLOCATED:
                    if not free.popleft_if(b):
                        raise Inconsistent(
                            f"block {b} allocated to request {r.ref} is not "
                            "at the head of the free queue"
                        )
                    ref_cnts[b] = 1
                    r.block_ids += (b,)
                elif kind == _CACHED:
                    if b in block_hashes or not 0 < b < s.num_blocks:
                        raise Inconsistent(
                            f"block {b} cannot be cached (outside the pool or cached)"
                        )
                    block_hashes[b] = all_hashes[hashed]
                    hashed += 1
                else:
                    self._hit(r, (b,))
                    hit += 1
                continue
            blocks = all_blocks[at : at + size]
            at += size
            hashes: tuple[bytes, ...] = ()
            num_tokens = 0
            if kind == _EVICTED:
                hashes = tuple(block_hashes.pop(b) for b in blocks)
                ref = None
            else:
                ref = refs[owner]
                owner += 1
                r = reqs[ref]
                if kind == _ALLOCATED:
                    self._allocate(r, blocks)
                elif kind == _CACHED:
                    hashes = all_hashes[hashed : hashed + size]
                    hashed += size
                    self._cache(blocks, hashes)
                elif kind == _FREED:
                    self._free(r, blocks)
                else:
                    num_tokens = kv.hit_tokens[hit]
                    hit += 1
                    self._hit(r, blocks)
            if view:
                self.kv_view.append(KVEvent(kind, ref, blocks, hashes, num_tokens))

    def _allocate(self, r: RequestState, blocks: tuple[int, ...]) -> None:
        s = self.s
        if s.free.popleft_n(len(blocks)) != list(blocks):
            raise Inconsistent(
                f"blocks {list(blocks)[:8]} allocated to request {r.ref} are "
                "not at the head of the free queue"
            )
        for b in blocks:
            s.ref_cnts[b] = 1
        r.block_ids += blocks

    def _free(self, r: RequestState, blocks: tuple[int, ...]) -> None:
        s = self.s
        if blocks != r.block_ids[::-1]:
            raise Inconsistent(f"request {r.ref} freed blocks that are not its table, tail first")
        r.block_ids = ()
        head: list[int] = []
        tail: list[int] = []
        ref_cnts, hashes = s.ref_cnts, s.block_hashes
        for b in blocks:
            ref_cnts[b] -= 1
            if ref_cnts[b] == 0:
                (tail if b in hashes else head).append(b)
        s.free.prepend_n(head)
        s.free.append_n(tail)

    def _hit(self, r: RequestState, blocks: tuple[int, ...]) -> None:
        s = self.s
        for b in blocks:
            if b not in s.block_hashes:
                raise Inconsistent(f"prefix hit on block {b}, which holds no hash")
            if s.ref_cnts[b] == 0:
                s.free.remove(b)
            s.ref_cnts[b] += 1
        r.block_ids += blocks

    def _cache(self, blocks: tuple[int, ...], hashes: tuple[bytes, ...]) -> None:
        s = self.s
        if len(hashes) != len(blocks):
            raise Inconsistent(f"{len(blocks)} blocks cached with {len(hashes)} hashes")
        for b, h in zip(blocks, hashes):
            if not 0 < b < s.num_blocks or b in s.block_hashes:
                raise Inconsistent(f"block {b} cannot be cached (outside the pool or cached)")
            s.block_hashes[b] = h


def _steady(rec: Step) -> bool:
    """Whether step `rec` holds nothing but its leading decodes (one token and one sample
    each), its KV events and its counters: _Apply._steady applies it."""
    return not (
        rec.arrivals
        or rec.admissions
        or rec.preemptions
        or rec.finishes
        or rec.scheduled
        or rec.other_samples
        or rec.spec_accepted
        or rec.decode_skips
        or rec.sample_counts is not None
        or rec.running is not None
        or rec.waiting is not None
    )


def arrived(a: Arrival, step: int) -> RequestState:
    """A request as it arrives in `step`: waiting, nothing computed yet."""
    return RequestState(
        a.ref,
        a.request_id,
        Status.WAITING,
        a.num_prompt_tokens,
        0,
        0,
        (),
        0,
        a.priority,
        a.arrival_time,
        -1,
        a.sampling.max_tokens,
        step,
    )


def _sampled(r: RequestState, count: int, step: int) -> None:
    if count and not r.num_output_tokens:
        r.first_token_step = step
    r.num_output_tokens += count


def _explicit(refs: tuple[int, ...], s: State, what: str) -> list[int]:
    reqs = s.requests
    if len(set(refs)) != len(refs) or any(r not in reqs for r in refs):
        raise Inconsistent(f"the {what} queue names unknown or repeated requests")
    return list(refs)
