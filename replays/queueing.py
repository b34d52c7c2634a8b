"""Queueing: who waited longest before getting in, why, and the knob behind the why.

Most incidents are queueing, not preemption: a request at the waiting queue's head that
cannot be admitted holds up everyone behind it (head-of-line blocking), a full pool keeps
a high-priority request out while low-priority work runs (vLLM's priority policy never
preempts to admit), a token budget or `max_num_seqs` caps admission. `QueueScan` reads a
trace a slice at a time (like `replays.storms.IncidentScan`) and keeps, per request, the
steps from its arrival to its first admission with the reasons the step records give;
head-of-line episodes (who was at the head, for how long, whom it held up); and the steps
a request waited while one of worse priority ran (a priority inversion); and the shared
prompt prefixes the prefix cache lost (`CacheLoss`): a request that shares full blocks
with an earlier one's prompt but found fewer of them cached at its admission.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from recorder.codec import decode
from recorder.derive import leading_decodes
from recorder.reader import TraceReader
from recorder.schema import (
    NOT_REACHED,
    REASON_KNOBS,
    WAIT_LABELS,
    Arrival,
    Reason,
    RecordType,
    Snapshot,
    Status,
    Step,
)
from replays.reducer import apply
from replays.scan import Digested, RecordScan
from replays.state import Inconsistent, State

TOP = 64  # the longest waits (and head-of-line blockings) kept
INVERSION_STEPS = 2  # steps waited while worse priority ran, for a flagged inversion
T = TypeVar("T")
MAX_PREFIXES = 1024  # distinct shared prefixes followed at most (memory stays bounded)
PREFIX_TOKENS = 4096  # tokens of a prefix's first prompt kept to compare later ones with
CACHE_KNOBS = "num_blocks/kv_cache_memory"  # what keeps more of a prefix cached
_BLOCKING = (Reason.KV_BLOCKS, Reason.WATERMARK, Reason.FULL_PROMPT, Reason.MAX_NUM_SEQS)


def decoders(rec: Step, before: State) -> tuple[int, ...]:
    """The step's leading decodes: the first `num_decodes` of running as schedule() found
    it (aborts between steps had taken requests out), passing over its `decode_skips`.
    Take them before the state moves `before` on."""
    aborted = {f.ref for f in rec.finishes if f.status == Status.FINISHED_ABORTED}
    running = [r for r in before.running if r not in aborted] if aborted else before.running
    if not rec.decode_skips:
        return tuple(running[: rec.num_decodes])
    try:
        return tuple(leading_decodes(running, rec.num_decodes, rec.decode_skips))
    except ValueError as e:
        raise Inconsistent(f"step {rec.step}: {e}") from None


def unscheduled(rec: Step, leading: Iterable[int], after: State) -> tuple[tuple[int, int], ...]:
    """(ref, reason) for every unfinished request step `rec` did not schedule, in ref
    order; `leading`: its leading decodes, `after`: the state after it."""
    scheduled = {*leading, *(e.ref for e in rec.scheduled)}
    if scheduled.issuperset(after.requests):
        # Every unfinished request was scheduled (a busy engine's usual step): one C-level
        # set test instead of a pass over the requests, step after step of a live view.
        return ()
    why: dict[int, int] = {s.ref: s.reason for s in rec.shortfalls if s.got == 0}
    for p in rec.preemptions:
        why[p.victim] = Reason.PREEMPTED
    for stop, queue in ((rec.running_stop, after.running), (rec.waiting_stop, after.waiting)):
        if stop is None:
            continue
        left = [ref for ref in queue if ref not in scheduled and ref not in why]
        for i, ref in enumerate(left):
            why[ref] = stop.head if i == 0 else stop.rest
    return tuple((ref, why.get(ref, NOT_REACHED)) for ref in after.requests if ref not in scheduled)


def reason_label(code: int) -> str:
    return WAIT_LABELS.get(code, f"reason {code}")


def knobs(code: int) -> str:
    """The knobs behind a reason, as `--set` names them ("" for none)."""
    return "/".join(REASON_KNOBS.get(code, ()))


@dataclass(frozen=True, slots=True)
class QueueWait:
    """One request's time in the waiting queue before its first admission."""

    request_id: str
    priority: int
    arrival_step: int
    steps: int  # steps from its arrival to its first admission (or to the last step scanned)
    still: bool  # not admitted yet: it waits on
    reason: str  # the reason of most of those steps, in words
    knob: str  # the knobs behind it ("" when the reason names none)
    held_by: str  # behind the queue head most of the time: the head's id
    inversion: int  # steps it waited while a request of worse priority ran
    tenant: str | None = None  # whose it is, where its arrival says

    @property
    def inverted(self) -> bool:
        """A priority inversion worth flagging (one step of it is noise: a step's order)."""
        return self.inversion >= INVERSION_STEPS


@dataclass(frozen=True, slots=True)
class HeadOfLine:
    """A request at the waiting queue's head that could not be admitted, and whom that
    held up (requests behind it that its stop left out)."""

    request_id: str  # the head
    priority: int
    first_step: int  # the first step of the episode
    steps: int  # how long it blocked
    reason: str  # why the head could not get in (most steps)
    knob: str
    held: tuple[str, ...]  # every request it held up, in the order first met


@dataclass(frozen=True, slots=True)
class CacheLoss:
    """A shared prompt prefix the prefix cache lost: requests after the first that share
    full blocks of its prompt, and how many of those blocks they found cached."""

    first: str  # the request whose prompt the prefix was first seen in
    sharers: int  # requests that shared it after the first (admitted)
    losses: int  # of them, those that found less of it cached than they shared
    hit_tokens: int  # tokens they found cached, of the shared prefix
    shared_tokens: int  # tokens they shared with the first (in full blocks)
    first_loss_step: int  # the step of the first admission that found less
    first_loss: str  # its request
    knob: str = CACHE_KNOBS

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.shared_tokens if self.shared_tokens else 0.0


@dataclass(slots=True)
class _Prefix:
    """A prompt's first block, and what later prompts sharing it found cached."""

    first: str
    head: tuple[int, ...] | tuple[bytes, ...]  # its first prompt (tokens, or block hashes)
    hashed: bool  # head is block hashes (a redacted trace)
    sharers: int = 0
    losses: int = 0
    hit_tokens: int = 0
    shared_tokens: int = 0
    first_loss_step: int = -1
    first_loss: str = ""


def _shared_blocks(p: _Prefix, a: Arrival, block_size: int) -> int:
    """Full blocks request `a`'s prompt shares with the prefix's first prompt."""
    if p.hashed:
        mine: tuple[int, ...] | tuple[bytes, ...] = a.prompt_block_hashes or ()
        n = 0
        for x, y in zip(p.head, mine):
            if x != y:
                break
            n += 1
        return n
    tokens = a.prompt_token_ids or ()
    n = 0
    for x, y in zip(p.head, tokens):
        if x != y:
            break
        n += 1
    return n // block_size


@dataclass(slots=True)
class _Waiter:
    """A request not admitted yet (mutable while the scan goes on)."""

    ref: int
    request_id: str
    priority: int
    arrival: int
    tenant: str | None = None
    counts: dict[int, int] = field(default_factory=dict)  # reason -> steps
    heads: dict[str, int] = field(default_factory=dict)  # head id -> steps behind it
    inversion: int = 0


@dataclass(slots=True)
class _Episode:
    """A head-of-line blocking going on."""

    head: str
    priority: int
    first: int
    last: int
    counts: dict[int, int] = field(default_factory=dict)  # the head's reasons -> steps
    held: dict[str, None] = field(default_factory=dict)  # ids, in the order first met


def _dominant(counts: dict[int, int]) -> int:
    """The reason of most steps; behind the queue head loses a tie (it is a symptom)."""
    return max(counts, key=lambda c: (counts[c], c != Reason.HEAD_OF_LINE))


def _wait(w: _Waiter, end: int, still: bool) -> QueueWait:
    code = _dominant(w.counts)
    held_by = (
        max(w.heads, key=lambda h: w.heads[h]) if code == Reason.HEAD_OF_LINE and w.heads else ""
    )
    return QueueWait(
        w.request_id,
        w.priority,
        w.arrival,
        end - w.arrival,
        still,
        reason_label(code),
        knobs(code),
        held_by,
        w.inversion,
        w.tenant,
    )


def _blocking(e: _Episode) -> HeadOfLine:
    code = _dominant(e.counts)
    return HeadOfLine(
        e.head,
        e.priority,
        e.first,
        e.last - e.first + 1,
        reason_label(code),
        knobs(code),
        tuple(e.held),
    )


class QueueScan(RecordScan):
    """Reads a trace's step records from the start a slice at a time (`advance`),
    replaying its queues, and keeps the longest waits and head-of-line blockings found
    (TOP of each: memory stays bounded however long the trace)."""

    def __init__(self, reader: TraceReader, tail: bool = False) -> None:
        super().__init__(reader, tail)
        self.state: State | None = (
            State.initial(reader.header) if reader.header.first_step == 0 else None
        )
        self._waiting: dict[int, _Waiter] = {}  # refs not admitted yet
        self._prio: dict[int, int] = {}  # unfinished refs -> priority
        self._done: list[tuple[int, int, QueueWait]] = []  # min-heap: the longest admitted
        self._episode: _Episode | None = None
        self._blockings: list[tuple[int, int, HeadOfLine]] = []  # min-heap: the longest
        self._seq = 0  # heap tie-break
        # After take(): the scan holds no state of its own (it saw the taker's); the next
        # advance() asks this for a copy of the state after its last step.
        self._resume: Callable[[int], State] | None = None

        header = reader.header
        self._block_size = header.block_size
        self._caching = header.config.get("enable_prefix_caching", True) is not False
        self._prefixes: dict[object, _Prefix] = {}  # by the first block (tokens or hash)
        # ref -> its prefix, the blocks it shares, its id: until its first admission
        self._sharing: dict[int, tuple[_Prefix, int, str]] = {}

    def _record(self, offset: int, rtype: int, body: bytes) -> bool:
        if rtype == RecordType.STEP and self._resume is not None:
            self.state, self._resume = self._resume(self.last_step), None
        if rtype == RecordType.SNAPSHOT and self.state is None and self._resume is None:
            snap = decode(rtype, body, offset)
            if isinstance(snap, Snapshot):  # a trace that starts mid-run
                self.state = State.from_snapshot(self.reader.header, snap)
                for r in snap.requests:
                    self._prio[r.ref] = r.priority
        elif rtype == RecordType.STEP and self.state is not None:
            rec = decode(rtype, body, offset)
            if isinstance(rec, Step):
                self._step(self.state, rec)
                return True
        return False

    def _keep(self, heap: list[tuple[int, int, T]], steps: int, item: T) -> None:
        self._seq += 1
        entry = (steps, -self._seq, item)  # ties: the earlier stays
        if len(heap) < TOP:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)

    def take(self, d: Digested) -> bool:
        """Count step `d` as another walk of the same trace has decoded and applied it,
        when it is the next step this scan would read: the record is then neither
        decoded nor applied again (a live view that digests every step for its log
        would otherwise pay for each twice). The scan keeps `d.resume`, not `d.after`,
        to read on by itself later. Whether it took the step."""
        if not self._next(d):
            return False
        if self.state is None and self._resume is None:
            return False  # a mid-run trace's scan that has not met its snapshot yet
        self.state, self._resume = None, d.resume
        self._taken(d)
        self._count(d.rec, d.left, d.after)
        return True

    def _step(self, state: State, rec: Step) -> None:
        leading = decoders(rec, state)
        apply(state, rec)
        self._count(rec, unscheduled(rec, leading, state), state)

    def _count(self, rec: Step, left_pairs: tuple[tuple[int, int], ...], state: State) -> None:
        """What step `rec` adds to the waits and blockings; `state`: the state after it."""
        for a in rec.arrivals:
            self._prio[a.ref] = a.priority
            self._waiting[a.ref] = _Waiter(a.ref, a.request_id, a.priority, rec.step, a.tenant)
            if self._caching:
                self._prefix_arrival(a)
        for ad in rec.admissions:
            shared = self._sharing.pop(ad.ref, None) if not ad.resumed else None
            if shared is not None:
                self._prefix_admission(*shared, ad.cached_tokens, rec.step)
            w = self._waiting.pop(ad.ref, None)
            if w is not None and w.counts and rec.step > w.arrival:
                self._keep(self._done, rec.step - w.arrival, _wait(w, rec.step, False))
        for f in rec.finishes:  # aborted while waiting: its wait ends unadmitted
            self._waiting.pop(f.ref, None)
            self._sharing.pop(f.ref, None)
            self._prio.pop(f.ref, None)
        left = dict(left_pairs)
        worst_running: int | None = None  # worked out when a waiting request needs it:
        worst_known = False  # most steps leave none unscheduled, and it costs a pass
        head = state.waiting[0] if state.waiting else None
        blocked = head is not None and rec.waiting_stop is not None and left.get(head) in _BLOCKING
        head_id = state.request_id(head) if blocked and head is not None else None
        for ref, code in left.items():
            w = self._waiting.get(ref)
            if w is None:
                continue
            if not worst_known:
                prio = self._prio
                worst_running = max((prio.get(r, 0) for r in state.running), default=None)
                worst_known = True
            w.counts[code] = w.counts.get(code, 0) + 1
            if code == Reason.HEAD_OF_LINE and head_id is not None and head != ref:
                w.heads[head_id] = w.heads.get(head_id, 0) + 1
            if worst_running is not None and w.priority < worst_running:
                w.inversion += 1
        self._head_of_line(rec.step, head if blocked else None, left, state)
        self.last_step = rec.step

    def _head_of_line(
        self, step: int, head: int | None, left: dict[int, int], state: State
    ) -> None:
        e = self._episode
        if e is not None and (
            head is None or state.request_id(head) != e.head or step != e.last + 1
        ):
            self._episode = None
            if e.held:  # a head that held nobody up is a wait, not a blocking
                self._keep(self._blockings, e.last - e.first + 1, _blocking(e))
            e = None
        if head is None:
            return
        if e is None:
            e = self._episode = _Episode(
                state.request_id(head), self._prio.get(head, 0), step, step
            )
        e.last = step
        code = left[head]
        e.counts[code] = e.counts.get(code, 0) + 1
        for ref, c in left.items():
            if c == Reason.HEAD_OF_LINE and ref != head:
                e.held[state.request_id(ref)] = None

    def _prefix_arrival(self, a: Arrival) -> None:
        bs = self._block_size
        key: object
        head: tuple[int, ...] | tuple[bytes, ...]
        if a.prompt_token_ids is not None and len(a.prompt_token_ids) >= bs:
            tokens = tuple(a.prompt_token_ids[:PREFIX_TOKENS])
            key, head, hashed = tokens[:bs], tokens, False
        elif a.prompt_block_hashes:
            hashes = tuple(a.prompt_block_hashes[:PREFIX_TOKENS])
            key, head, hashed = hashes[0], hashes, True
        else:
            return  # shorter than a block: nothing to cache
        p = self._prefixes.get(key)
        if p is None:
            if len(self._prefixes) < MAX_PREFIXES:
                self._prefixes[key] = _Prefix(a.request_id, head, hashed)
            return
        shared = _shared_blocks(p, a, bs)
        if shared:
            self._sharing[a.ref] = (p, shared, a.request_id)

    def _prefix_admission(
        self, p: _Prefix, blocks: int, request_id: str, cached: int, step: int
    ) -> None:
        # K7: at least the prompt's last token is computed, so a prompt that is all
        # shared prefix ending on a block boundary cannot hit its last block.
        shared = blocks * self._block_size
        hit = min(cached, shared)
        p.sharers += 1
        p.hit_tokens += hit
        p.shared_tokens += shared
        if hit < shared - self._block_size:
            p.losses += 1
            if p.first_loss_step < 0:
                p.first_loss_step, p.first_loss = step, request_id

    def cache_losses(self) -> tuple[CacheLoss, ...]:
        """The shared prefixes the cache lost at least once, most losses first."""
        out = [
            CacheLoss(
                p.first,
                p.sharers,
                p.losses,
                p.hit_tokens,
                p.shared_tokens,
                p.first_loss_step,
                p.first_loss,
            )
            for p in self._prefixes.values()
            if p.losses
        ]
        out.sort(key=lambda c: (-c.losses, c.hit_rate, c.first_loss_step))
        return tuple(out[:TOP])

    def waits(self) -> tuple[QueueWait, ...]:
        """The TOP longest waits before first admission (those still waiting counted to
        the last step scanned), longest first."""
        out = [w for _, _, w in self._done]
        out.extend(
            _wait(w, self.last_step, True)
            for w in self._waiting.values()
            if w.counts and self.last_step > w.arrival
        )
        out.sort(key=lambda q: (-q.steps, q.arrival_step, q.request_id))
        return tuple(out[:TOP])

    def head_of_line(self) -> tuple[HeadOfLine, ...]:
        """The TOP longest head-of-line blockings, the one going on included, longest
        first."""
        found = [h for _, _, h in self._blockings]
        if self._episode is not None and self._episode.held:
            found.append(_blocking(self._episode))
        found.sort(key=lambda h: (-h.steps, h.first_step))
        return tuple(found[:TOP])
