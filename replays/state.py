"""The engine's state as a trace alone can rebuild it: requests, queues and the block map.

`State` is what the reducer (replays.reducer) updates one step record at a time. It
starts from the header (`State.initial`) or from any snapshot record
(`State.from_snapshot`), turns back into one (`to_snapshot`), copies cheaply (`copy`), and
keeps a compact copy for later (`keyframe`, the Timeline's keyframes); `to_snapshot` is
field for field what the engine's own snapshot says. Its requests are the same
RequestState records that snapshots hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, starmap
from operator import attrgetter
from typing import Any

from recorder.errors import TraceError
from recorder.schema import MAX_BLOCKS, Header, RequestState, Snapshot, Status
from replays.freequeue import FreeQueue
from replays.slots import SlotPool

POLICIES = ("fcfs", "priority")


class Inconsistent(TraceError):
    """A record that does not fit the state it is applied to."""


@dataclass(slots=True)
class State:
    """Requests, queues and the block map after step `step`.

    Invariants (check_invariants): no block is both free and owned; a block's ref count is
    the number of tables holding it; free + owned blocks = the usable blocks 1..N-1."""

    policy: str  # "fcfs" or "priority"
    num_blocks: int  # blocks in the pool, the null block 0 included
    block_size: int  # tokens per block
    step: int  # the last step applied
    next_ref: int  # the ref the next arrival gets
    requests: dict[int, RequestState]  # unfinished requests by ref
    running: list[int]  # running queue (refs), in order
    waiting: list[int]  # waiting queue (refs), in admission order
    free: FreeQueue  # free blocks, head first
    ref_cnts: list[int]  # per block id
    block_hashes: dict[int, bytes] = field(default_factory=dict)  # cached blocks' hashes
    # (1.9) a token pool tracked slot by slot (Header.slot_map); None: the block map is
    # the pool (or a token pool the trace does not track)
    slots: SlotPool | None = None

    @classmethod
    def initial(cls, header: Header) -> State:
        """The state before a trace's first step; only for traces that start at step 0."""
        _check_header(header)
        if header.first_step != 0:
            raise TraceError(
                f"the trace starts at step {header.first_step}: start from its "
                "first snapshot instead"
            )
        n = header.num_blocks
        return cls(
            header.policy,
            n,
            header.block_size,
            -1,
            0,
            {},
            [],
            [],
            FreeQueue(n, range(1, n)),
            [0] * n,
            slots=SlotPool.initial(n) if header.slot_map else None,
        )

    @classmethod
    def from_snapshot(cls, header: Header, snap: Snapshot) -> State:
        """The state a snapshot record describes (validated: it may come from anywhere)."""
        _check_header(header)
        n = header.num_blocks
        rows = snap.requests
        refs = list(map(_REF, rows))
        owned = list(chain.from_iterable(map(_BLOCK_IDS, rows)))
        requests: dict[int, RequestState] = {}
        ref_cnts = [0] * n
        if (
            len(set(refs)) == len(refs)
            and (not refs or max(refs) < snap.next_ref)
            and (not rows or max(map(_STATUS, rows)) <= Status.PREEMPTED)
            and (not owned or (min(owned) >= 1 and max(owned) < n))
        ):
            # What the loop below checks request by request, in C passes; the copies made
            # without a Python call each.
            requests = dict(zip(refs, starmap(RequestState, map(_REQUEST_FIELDS, rows))))
            for b in owned:
                ref_cnts[b] += 1
        else:  # something is wrong: this loop raises for the first request it is in
            for r in rows:
                if r.ref in requests or r.ref >= snap.next_ref:
                    raise Inconsistent(f"snapshot: bad or repeated ref {r.ref}")
                requests[r.ref] = _request(r)
                _check_blocks(r.block_ids, n)
                for b in r.block_ids:
                    ref_cnts[b] += 1
        _check_refs(snap.running, requests, "running")
        _check_refs(snap.waiting, requests, "waiting")
        _check_blocks(snap.free_queue, n)
        if len(set(snap.free_queue)) != len(snap.free_queue):
            raise Inconsistent("snapshot: a block is twice in the free queue")
        if len(snap.cached_block_ids) != len(snap.cached_hashes):
            raise Inconsistent("snapshot: cached blocks and hashes differ in number")
        _check_blocks(snap.cached_block_ids, n)
        state = cls(
            header.policy,
            n,
            header.block_size,
            snap.step,
            snap.next_ref,
            requests,
            list(snap.running),
            list(snap.waiting),
            FreeQueue(n, snap.free_queue),
            ref_cnts,
            dict(zip(snap.cached_block_ids, snap.cached_hashes)),
            slots=(
                SlotPool.from_snapshot(n, snap.slot_rows, snap.free_slot_runs, snap.evictable_slots)
                if header.slot_map
                else None
            ),
        )
        # The ref counts were counted from the tables, the free queue's blocks checked
        # distinct and the cached blocks in the pool just above: only ownership is left.
        state._check_ownership(ref_cnts, snap.free_queue)
        return state

    def copy(self) -> State:
        # block_hashes.copy(), not dict(...): a dict that has had deletions is rebuilt key
        # by key by dict(), while copy() clones its table in one memcpy unless a third of
        # it is deleted slots (CPython's PyDict_Copy). The reducer evicts blocks every
        # step, so the hashes of a running engine always have some: 0.05 ms, not 0.28,
        # for 16,000 cached blocks.
        return State(
            self.policy,
            self.num_blocks,
            self.block_size,
            self.step,
            self.next_ref,
            {ref: r.copy() for ref, r in self.requests.items()},
            list(self.running),
            list(self.waiting),
            self.free.copy(),
            list(self.ref_cnts),
            self.block_hashes.copy(),
            None if self.slots is None else self.slots.copy(),
        )

    def keyframe(self) -> Keyframe:
        """A frozen copy to rebuild this state from (Keyframe.state)."""
        return Keyframe(
            self.policy,
            self.num_blocks,
            self.block_size,
            self.step,
            self.next_ref,
            tuple(map(_REQUEST_FIELDS, self.requests.values())),
            tuple(self.running),
            tuple(self.waiting),
            self.free.copy(),
            tuple(self.ref_cnts),
            self.block_hashes.copy(),
            None if self.slots is None else self.slots.copy(),
        )

    def request_id(self, ref: int) -> str:
        return self.requests[ref].request_id

    def block_owners(self) -> list[list[int]]:
        """For each block id, the refs of the requests whose tables hold it (the block
        map's owners; a free block has none, a shared one several)."""
        owners: list[list[int]] = [[] for _ in range(self.num_blocks)]
        for ref, r in self.requests.items():
            for b in r.block_ids:
                owners[b].append(ref)
        return owners

    def to_snapshot(self) -> Snapshot:
        cached = sorted(self.block_hashes.items())
        pool = self.slots
        return Snapshot(
            step=self.step,
            next_ref=self.next_ref,
            requests=tuple(self.requests[ref].copy() for ref in sorted(self.requests)),
            running=tuple(self.running),
            waiting=tuple(self.waiting),
            free_queue=tuple(self.free),
            cached_block_ids=tuple(b for b, _ in cached),
            cached_hashes=tuple(h for _, h in cached),
            slot_rows=() if pool is None else pool.snapshot_rows(),
            free_slot_runs=() if pool is None else pool.free_runs(),
            evictable_slots=0 if pool is None else pool.evictable,
        )

    def check_invariants(self, free: Sequence[int] | None = None) -> None:
        """Raise Inconsistent unless the block map holds together (docs/contracts.md K8). `free`:
        the free queue's blocks when the caller has them as a list already."""
        held = [0] * self.num_blocks
        for r in self.requests.values():
            for b in r.block_ids:
                held[b] += 1
        if held != self.ref_cnts:
            bad = next(b for b, (h, c) in enumerate(zip(held, self.ref_cnts)) if h != c)
            raise Inconsistent(
                f"block {bad}: ref count {self.ref_cnts[bad]} but {held[bad]} tables hold it"
            )
        if free is None:
            free = list(self.free)
        if len(free) != len(self.free) or len(set(free)) != len(free):
            raise Inconsistent("the free queue is malformed")
        self._check_ownership(held, free)
        for b in self.block_hashes:
            if not 0 < b < self.num_blocks:
                raise Inconsistent(f"a hash for block {b}, outside the pool")

    def _check_ownership(self, held: list[int], free: Sequence[int]) -> None:
        """No block both free and owned, and every usable block one or the other. `held`:
        per block, the tables holding it; `free`: the free queue's blocks, distinct."""
        if held[0] or 0 in self.free:
            raise Inconsistent("the null block 0 is in use or free")
        owned = len(held) - held.count(0)
        if any(map(held.__getitem__, free)):
            raise Inconsistent("a block is both free and owned")
        if owned + len(free) != self.num_blocks - 1:
            raise Inconsistent(
                f"{owned} owned + {len(free)} free blocks != {self.num_blocks - 1} usable"
            )


_REQUEST_FIELDS = attrgetter(*RequestState.__match_args__)
_REF, _STATUS, _BLOCK_IDS = attrgetter("ref"), attrgetter("status"), attrgetter("block_ids")


@dataclass(frozen=True, slots=True)
class Keyframe:
    """A state kept for later, in a compact form that is cheap to make and to drop.

    Each request is a tuple of its fields, made in one C-level pass. Most keyframes are
    never used: a jump keeps several near its target in case the user steps back. Their
    RequestState objects are built only when one is used (`state`). Nothing here is
    shared with a live State: the containers are copies, and the tuples are immutable."""

    policy: str
    num_blocks: int
    block_size: int
    step: int
    next_ref: int
    requests: tuple[tuple[Any, ...], ...]  # each request's fields, in RequestState order
    running: tuple[int, ...]
    waiting: tuple[int, ...]
    free: FreeQueue  # never changed: state() copies it
    ref_cnts: tuple[int, ...]
    block_hashes: dict[int, bytes]  # never changed: state() copies it
    slots: SlotPool | None  # never changed: state() copies it

    def state(self) -> State:
        """A new State equal to the one this keyframe was taken from."""
        return State(
            self.policy,
            self.num_blocks,
            self.block_size,
            self.step,
            self.next_ref,
            {row[0]: RequestState(*row) for row in self.requests},
            list(self.running),
            list(self.waiting),
            self.free.copy(),
            list(self.ref_cnts),
            self.block_hashes.copy(),
            None if self.slots is None else self.slots.copy(),
        )


def _check_header(header: Header) -> None:
    if not 2 <= header.num_blocks <= MAX_BLOCKS:
        raise TraceError(f"header: num_blocks={header.num_blocks}: must be in [2, {MAX_BLOCKS}]")
    if header.block_size < 1:
        raise TraceError(f"header: block_size={header.block_size}: must be >= 1")
    if header.policy not in POLICIES:
        raise TraceError(f"header: policy={header.policy!r}: must be one of {POLICIES}")


def _check_blocks(blocks: tuple[int, ...], num_blocks: int) -> None:
    """Every block id within the pool, checked with two C-level passes (snapshots list
    tens of thousands of blocks)."""
    if blocks and (min(blocks) < 1 or max(blocks) >= num_blocks):
        bad = next(b for b in blocks if not 0 < b < num_blocks)
        _check_block(bad, num_blocks)


def _check_block(block: int, num_blocks: int) -> None:
    if not 0 < block < num_blocks:
        raise Inconsistent(f"block {block} is outside the pool 1..{num_blocks - 1}")


def _check_refs(refs: tuple[int, ...], requests: dict[int, RequestState], what: str) -> None:
    if len(set(refs)) != len(refs) or any(r not in requests for r in refs):
        raise Inconsistent(f"{what} queue names unknown or repeated requests")


def _request(r: RequestState) -> RequestState:
    if r.status > Status.PREEMPTED:
        raise Inconsistent(f"request {r.ref} has finished status {r.status}")
    return r.copy()
