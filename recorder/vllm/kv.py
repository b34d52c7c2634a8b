"""Taps on vLLM's KV cache manager and block pool: every block movement, with block ids
and the request it belongs to, as the step's KV events.

Three modes inside schedule(). FULL wraps `allocate_slots`, so that each allocation is
seen as it happens, with what the decisions need (budget, cut-short reasons, admission
failures). LEAN leaves `allocate_slots` alone: when only running requests that decode one
token each can be scheduled and no allocation can fail (see `Tap.pass_mode`), the
allocations are read once from vLLM's SchedulerOutput after schedule(), and the blocks
that got hashes from the block pool's `cache_full_blocks`, which vLLM calls only when a
block has filled. MIXED is LEAN for the running pass and FULL from the waiting pass on
(requests wait, so some may be admitted): the tap goes in when vLLM first looks at the
waiting queue. That keeps Python off the per-request path of a decode step.

The mirror of vLLM's block tables and cached hashes (KVReq.ids and .hashes, `block_hash`)
and the step's event log are built off vLLM's engine thread: the taps capture what vLLM's
calls and SchedulerOutput hold already (block ids, counts, the request) as operations, in
order, and whichever thread first needs a step's events (the recorder's encoding thread,
as a rule) runs the operations up to that step's end (`run_ops`, `PendingKV`). The engine
thread keeps only what its own taps read back: each request's count of cached blocks.
"""

from __future__ import annotations

import inspect
import logging
import struct
import threading
from collections import deque
from collections.abc import Callable
from itertools import compress
from typing import Any, cast

from engine.config import EngineConfig
from engine.kv.events import KVEventLog
from engine.kv.hashing import ROOT_HASH, hash_block
from engine.records import KVEvents, KVKind, Reason
from engine.rules import admission_failure
from recorder.vllm.lazyhash import LazyHash, short, whole

# Outside schedule(); schedule() tapped per allocation; or not; recording has stopped; or
# not during the running pass, and per allocation from the waiting pass on.
IDLE, FULL, LEAN, STOPPED, MIXED = 0, 1, 2, 3, 4
_ALLOCATED, _CACHED, _EVICTED = KVKind.ALLOCATED, KVKind.CACHED, KVKind.EVICTED
_PREFIX_HIT, _FREED = KVKind.PREFIX_HIT, KVKind.FREED
log = logging.getLogger("schedtop.recorder.vllm")
_PLAIN_CACHE_ARGS = {"blocks", "num_cached_blocks", "num_full_blocks"}  # cache_full_blocks'
_CACHE_FULL_BLOCKS_ARGS = (  # BlockPool.cache_full_blocks's parameters in vLLM 0.33
    "request",
    "blocks",
    "num_cached_blocks",
    "num_full_blocks",
    "block_size",
    "kv_cache_group_id",
    "block_mask",
)


class CutHashLog(KVEventLog):
    """The step's KV events, with CACHED hashes added as records keep them already."""

    __slots__ = ()
    whole_hashes = False


class KVReq:
    """The KV side of one live request, as the recording sees it: `cached` belongs to
    vLLM's engine thread (its taps read it back), the rest to whoever runs the KV
    operations (KVTaps.run_ops)."""

    __slots__ = ("ref", "ids", "hashes", "cached")

    def __init__(self, ref: int) -> None:
        self.ref = ref  # the request's ref in the trace
        self.ids: list[int] = []  # its table's block ids (vLLM's table, mirrored from events)
        # schedtop's (whole) hashes of its full blocks, each the next's parent: they
        # outlive a preemption (the tokens stay); those of blocks filled while decoding
        # are computed when first needed
        self.hashes: list[bytes | LazyHash] = []
        self.cached = 0  # leading blocks of its table that are cached


class PendingKV:
    """A step's KVEvents, frozen once the KV operations up to the step's end have run:
    read like KVEvents (attributes, comparison, len), which runs them on the reading
    thread if no other has yet. A step record holds one from vLLM's engine thread, and
    the recorder's encoding thread is the first to read it, as a rule."""

    __slots__ = ("events", "_run")

    def __init__(self, run: Callable[[PendingKV], None]) -> None:
        self.events: KVEvents | None = None
        self._run = run

    def get(self) -> KVEvents:
        events = self.events
        if events is None:
            self._run(self)
            events = self.events
            assert events is not None, "the operations that freeze a step's KV events ran"
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __eq__(self, other: object) -> bool:
        return self.get() == (other.get() if isinstance(other, PendingKV) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.get())

    def __repr__(self) -> str:
        return f"PendingKV({self.events!r})"


def resolved(events: Any) -> KVEvents:
    """`events` as KVEvents (a PendingKV's, once run)."""
    return events.get() if type(events) is PendingKV else cast(KVEvents, events)


class KVTaps:
    """The KV side of the recording state (`Tap` adds the decisions)."""

    config: EngineConfig

    def __init__(self, sched: Any, block_size: int) -> None:
        self.sched = sched
        self.kvm = sched.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.block_size = block_size
        # A full block's tokens as hash_block (engine.kv.hashing) packs them.
        self.pack_block = struct.Struct(f"<{block_size}Q").pack
        self.mode = IDLE
        # request id -> its KVReq, from when it arrives until it finishes (the engine
        # thread's: its taps read `cached`; the operations that need one carry it)
        self.kvreqs: dict[str, KVReq] = {}
        self.refs: dict[str, int] = {}  # request id -> ref, until it finishes
        # The KV operations not run yet, (function, arguments) in vLLM's order: the engine
        # thread appends (`defer`, which a MIXED step's waiting pass points at a list of
        # its own for a while), `run_ops` runs them under `ops_lock`.
        self.ops: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self.defer: Callable[[tuple[Callable[..., Any], tuple[Any, ...]]], None] = self.ops.append
        self.ops_lock = threading.Lock()
        self.waiting_ops: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None
        self.kv_failed: str | None = None  # why the operations found vLLM inconsistent
        # -- what the operations build (whoever runs them, under ops_lock) --
        self.kv: KVEventLog = CutHashLog()  # the step's events so far
        # block id -> its hash as traces keep it (or its LazyHash, of which bytes() is that)
        self.block_hash: dict[int, bytes | LazyHash] = {}
        self.wreqs: dict[str, KVReq] = {}  # kvreqs as of the operations run so far
        # LEAN: the blocks that filled, in order: (the capture `_fill_capture` made, blocks
        # allocated in the step before then). The allocations themselves are read off the
        # SchedulerOutput.
        self.lean_order: list[tuple[tuple[Any, ...], int]] = []
        self.free_queue = self.pool.free_block_queue  # vLLM's; its count is an attribute
        self.lean_free = 0  # LEAN, MIXED: free blocks when schedule() began
        self.pass_blocks = 0  # MIXED: blocks the running pass allocated
        self.raw_allocate: Any = None  # vLLM's allocate_slots
        self.tapped_allocate: Any = None  # the FULL-mode wrapper around it
        self.unwrapped = False  # vLLM's allocate_slots is in place, not the wrapper

    # -- running the operations ----------------------------------------------------------------

    def run_ops(self, until: PendingKV | None = None) -> None:
        """Run the KV operations deferred so far, in order (any thread): all of them, or
        until `until`'s events are frozen."""
        with self.ops_lock:
            ops = self.ops
            while ops and (until is None or until.events is None):
                fn, args = ops.popleft()
                try:
                    fn(*args)
                except Exception as e:  # the mirror is not to be trusted from here on
                    log.exception("a KV operation of the recording failed")
                    if self.kv_failed is None:
                        self.kv_failed = f"the KV mirror: {type(e).__name__}: {e}"

    def freeze_kv(self) -> PendingKV:
        """The step's events from here back to the last step's end (engine thread)."""
        pending = PendingKV(self.run_ops)
        self.defer((self._freeze, (pending,)))
        return pending

    def _freeze(self, pending: PendingKV) -> None:
        pending.events = self.kv.freeze()
        if self.kv:  # frozen into the record: the next step starts a new log
            self.kv = CutHashLog()

    def _fail(self, why: str) -> None:
        if self.kv_failed is None:
            self.kv_failed = why

    # -- installing --------------------------------------------------------------------------

    def install_kv(self) -> None:
        kvm, pool = self.kvm, self.pool
        free, cache_full = kvm.free, pool.cache_full_blocks
        lean_order = self.lean_order
        queue = self.free_queue
        kvreqs = self.kvreqs
        capture = self._fill_capture

        def on_filled(request: Any, blocks: Any, start: int, end: int) -> None:
            # vLLM calls cache_full_blocks only when a block of the request has filled:
            # its blocks[start:end] got hashes.
            mode = self.mode
            if mode in (LEAN, MIXED):  # logged after schedule(), with the owners
                done = capture(request, blocks, start, end)
                if done is not None:
                    lean_order.append((done, self.lean_free - queue.num_free_blocks))
            elif mode == IDLE:  # update_from_output (async scheduling caches there)
                self.filled(request, blocks, start, end)
            # FULL: the allocate_slots tap logs it after the allocation

        def cache_full_blocks(request: Any, *args: Any, **kw: Any) -> None:
            cache_full(request, *args, **kw)
            if not args and kw.get("block_mask") is None and kw.keys() >= _PLAIN_CACHE_ARGS:
                on_filled(request, kw["blocks"], kw["num_cached_blocks"], kw["num_full_blocks"])
            else:
                on_filled(request, None, 0, 0)  # not the plain case: look at the table

        def cache_full_blocks_plain(
            request: Any,
            blocks: Any,
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            block_mask: Any = None,
        ) -> None:
            # vLLM 0.33's signature, spelled out: no argument packing on this path.
            cache_full(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
            if block_mask is not None:
                on_filled(request, None, 0, 0)
            elif self.mode in (LEAN, MIXED):  # on_filled, inlined: a decode step
                done = capture(request, blocks, num_cached_blocks, num_full_blocks)
                if done is None:
                    return
                # Blocks only leave the free queue by allocation in a LEAN schedule(): the
                # count says how many were allocated before this block filled.
                lean_order.append((done, self.lean_free - queue.num_free_blocks))
            else:
                on_filled(request, blocks, num_cached_blocks, num_full_blocks)

        freed = self._freed

        def free_request(request: Any) -> None:
            if self.mode == STOPPED:
                free(request)
                return
            st = kvreqs.get(request.request_id)
            free(request)
            if st is not None:
                st.cached = 0
                self.defer((freed, (st,)))

        self.raw_allocate = kvm.allocate_slots
        self.tapped_allocate = self._allocate_tap()
        names = list(inspect.signature(cache_full).parameters)
        plain = names == list(_CACHE_FULL_BLOCKS_ARGS)
        pool.cache_full_blocks = cache_full_blocks_plain if plain else cache_full_blocks
        kvm.free = free_request
        waiting = self.sched.waiting
        peek = waiting.peek_request

        def peek_request() -> Any:
            # vLLM's waiting pass looks at the head of the queue before it admits anything;
            # the running pass never does: in a MIXED step, the running pass is over.
            if self.mode == MIXED:
                self.end_running_pass()
            return peek()

        waiting.peek_request = peek_request
        kvm.allocate_slots = self.tapped_allocate

    def set_mode(self, mode: int) -> None:
        """FULL puts the allocate_slots wrapper in, LEAN, MIXED and STOPPED take it out."""
        lean = mode in (LEAN, STOPPED, MIXED)
        if mode != IDLE and lean != self.unwrapped:
            self.kvm.allocate_slots = self.raw_allocate if lean else self.tapped_allocate
            self.unwrapped = lean
        self.mode = mode

    def _allocate_tap(self) -> Any:
        from vllm.v1.request import RequestStatus as VllmStatus

        running_status = VllmStatus.RUNNING
        allocate = self.kvm.allocate_slots
        tables = self.tables
        kvreqs = self.kvreqs
        allocated = self._allocated

        def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            rid = request.request_id
            self.alloc_for = rid
            step = self.step
            if request.status is running_status and not args and "new_computed_blocks" not in kw:
                # The running pass, in a step that may cut requests short or preempt.
                if step is not None:
                    pending = step.pending
                    if pending is None or pending[0] != rid:
                        wanted = (
                            request.num_tokens_with_spec
                            + request.num_output_placeholders
                            - request.num_computed_tokens
                        )
                        if wanted != num_new_tokens:  # cut short: say why, as schedtop would
                            step.pending = self._running_share(step, request, num_new_tokens)
                out = allocate(request, num_new_tokens, *args, **kw)
                if out is None:
                    return out  # a preemption follows, and a retry
                new = out.blocks[0]
                st = kvreqs[rid]
                if new:
                    self.defer((allocated, (st, [b.block_id for b in new])))
                table = tables()[rid]
                done = st.cached
                if done < len(table) and table[done].block_hash is not None:
                    self._on_cached(request)
                if step is not None:
                    self._count_running(step, rid, num_new_tokens)
                return out
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            num_hit_tokens = kw.get("num_new_computed_tokens", args[0] if args else 0)
            before = len(self._table(rid))
            out = allocate(request, num_new_tokens, *args, **kw)
            self._on_allocate(request, num_new_tokens, num_hit_tokens, hits, before, out)
            return out

        return allocate_slots

    # -- what the Tap provides ---------------------------------------------------------------

    alloc_for: str | None = None  # the request whose allocation is running
    step: Any = None  # the step being recorded (a _Step)

    def _running_share(self, step: Any, request: Any, n: int) -> Any:
        raise NotImplementedError

    def _count_running(self, step: Any, rid: str, n: int) -> None:
        raise NotImplementedError

    def _count_allocation(self, step: Any, request: Any, n: int, num_hits: int) -> None:
        raise NotImplementedError

    # -- vLLM's block state ------------------------------------------------------------------

    def tables(self) -> dict[str, list[Any]]:
        """vLLM's block tables (full attention: one KV cache group), by request id."""
        return cast(
            dict[str, list[Any]], self.kvm.coordinator.single_type_managers[0].req_to_blocks
        )

    def _table(self, rid: str) -> list[Any]:
        return self.tables().get(rid, [])

    # -- the engine thread's captures ----------------------------------------------------------

    def _fill_capture(
        self, request: Any, blocks: list[Any] | None, start: int, end: int
    ) -> tuple[Any, ...] | None:
        """vLLM just hashed blocks[start:end] of the request's table: what the CACHED
        event needs of vLLM's state now, (its KVReq, the request, first and end index,
        block ids), with its count of cached blocks moved on; None if none is new. The
        common case is one block after the known ones; else the table is read from the
        first block not known to be cached."""
        st = self.kvreqs.get(request.request_id)
        if st is None:
            return None
        if st.cached == start and end == start + 1 and blocks is not None and end <= len(blocks):
            st.cached = end
            return (st, request, start, end, [blocks[start].block_id])
        return self._cached_capture(request, st)

    def _cached_capture(self, request: Any, st: KVReq) -> tuple[Any, ...] | None:
        """The blocks of the request's table that got a hash since the last look (as
        `_fill_capture` gives them), None if none."""
        table = self._table(request.request_id)
        done = st.cached
        end = done
        while end < len(table) and table[end].block_hash is not None:
            end += 1
        if end == done:
            return None
        st.cached = end
        return (st, request, done, end, [b.block_id for b in table[done:end]])

    def filled(self, request: Any, blocks: list[Any] | None, start: int, end: int) -> None:
        """CACHED for blocks[start:end] of the request's table, which vLLM just hashed."""
        done = self._fill_capture(request, blocks, start, end)
        if done is not None:
            self.defer((self._cached, done))

    def _on_cached(self, request: Any) -> None:
        """CACHED for the request's table blocks that got a hash since the last look."""
        done = self._cached_capture(request, self.kvreqs[request.request_id])
        if done is not None:
            self.defer((self._cached, done))

    def _on_allocate(
        self, request: Any, n: int, num_hit_tokens: int, hits: Any, before: int, out: Any
    ) -> None:
        rid = request.request_id
        step = self.step
        if out is None:
            if step is not None and request.status.name != "RUNNING":
                step.wait_fail = self._admission_failure(request, n, num_hit_tokens, hits)
            return
        table = self._table(rid)
        st = self.kvreqs[rid]
        hit_ids = [b.block_id for b in hits.blocks[0]] if hits is not None and hits.blocks else []
        if hit_ids:
            self.defer((self._hit, (st, hit_ids, num_hit_tokens)))
            st.cached = before + len(hit_ids)
        new = table[before + len(hit_ids) :]
        if new:
            self.defer((self._allocated, (st, [b.block_id for b in new])))
        self._on_cached(request)
        if step is not None:
            self._count_allocation(step, request, n, num_hit_tokens)

    def end_running_pass(self) -> None:
        """MIXED: the running pass is over (the waiting pass begins, or schedule() ends).
        What follows is tapped (FULL) and deferred apart: it goes after the running
        pass's events, which only the SchedulerOutput will tell."""
        self.pass_blocks = self.lean_free - self.free_queue.num_free_blocks
        waiting_ops: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.waiting_ops = waiting_ops
        self.defer = waiting_ops.append
        self.set_mode(FULL)

    def mixed_events(self, out: Any) -> None:
        """A MIXED schedule()'s KV events: what came before it, the running pass's (as in
        a LEAN step, from the SchedulerOutput's running requests, which come before the
        resumed ones), then the waiting pass's, as tapped."""
        if self.waiting_ops is None:
            self.end_running_pass()  # no allocation for a waiting request
        assert self.waiting_ops is not None
        waiting_ops, self.waiting_ops = self.waiting_ops, None
        self.defer = self.ops.append
        cached_reqs = out.scheduled_cached_reqs
        m = len(cached_reqs.req_ids) - len(cached_reqs.resumed_req_ids)
        self.lean_events(out, m, self.pass_blocks)
        self.ops.extend(waiting_ops)

    def lean_events(self, out: Any, m: int | None = None, allocated: int | None = None) -> None:
        """A LEAN schedule()'s KV events, deferred: the allocations, in scheduling order
        from the SchedulerOutput, and the blocks that filled between them (`_lean`).
        MIXED: only the first `m` cached requests (the running pass's), which allocated
        `allocated` blocks."""
        if allocated is None:
            allocated = self.lean_free - self.free_queue.num_free_blocks
        lean_order = self.lean_order
        if not allocated and not lean_order:
            return  # most steps: no block allocated or filled
        cached_reqs = out.scheduled_cached_reqs
        fills = lean_order[:]
        lean_order.clear()
        self.defer(
            (self._lean, (cached_reqs.req_ids, cached_reqs.new_block_ids, m, allocated, fills))
        )

    # -- the operations (under ops_lock, on whichever thread runs them) ------------------------

    def _lean(
        self,
        req_ids: list[str],
        new_ids: list[Any],
        m: int | None,
        allocated: int,
        fills: list[tuple[tuple[Any, ...], int]],
    ) -> None:
        """The events of a LEAN schedule(), in the order vLLM made them: the allocations,
        in scheduling order (each with the hashes it dropped), and between them each block
        that filled, after as many allocated blocks as had left the free queue when it
        filled. vLLM's state is inconsistent (the recording stops) if the blocks
        allocated do not add up."""
        if m is not None:
            new_ids, req_ids = new_ids[:m], req_ids[:m]
        cached = self._cached
        if not allocated:
            for done, _ in fills:
                cached(*done)
            if new_ids.count(None) != len(new_ids):
                self._fail("vLLM's allocations in a step do not match its SchedulerOutput")
            return
        kv = self.kv
        # None: no new blocks (most requests, most steps).
        owners = compress(zip(req_ids, new_ids), new_ids)
        block_hash, wreqs = self.block_hash, self.wreqs
        done_blocks = 0  # blocks whose allocation is logged
        for fill, before in [*fills, (None, allocated)]:
            while done_blocks < before:
                owner = next(owners, None)
                if owner is None:
                    self._fail("vLLM's allocations in a step do not match its SchedulerOutput")
                    return
                st, ids = wreqs[owner[0]], owner[1][0]
                done_blocks += len(ids)
                if len(ids) != 1 or ids[0] in block_hash:  # not the one-block, hash-free case
                    self._allocated(st, ids)
                    continue
                kv.kinds.append(_ALLOCATED)  # KVEventLog.add, inlined
                kv.refs.append(st.ref)
                kv.sizes.append(1)
                kv.block_ids.append(ids[0])
                st.ids.append(ids[0])
            if fill is not None:
                cached(*fill)
        if done_blocks != allocated or next(owners, None) is not None:
            self._fail("vLLM's allocations in a step do not match its SchedulerOutput")

    def _allocated(self, st: KVReq, ids: list[int]) -> None:
        """ALLOCATED for blocks fresh from the free queue, after EVICTED for those of them
        that held a hash: vLLM drops a block's hash as it hands the block out (in
        BlockPool.get_new_blocks, the only place it evicts for a supported set-up), so
        the blocks evicted are the new ones this mirror still knows a hash for."""
        block_hash = self.block_hash
        gone = [b for b in ids if b in block_hash]
        if gone:
            self.kv.add(_EVICTED, None, gone, _as_bytes([block_hash.pop(b) for b in gone]))
        self.kv.add(_ALLOCATED, st.ref, ids)
        st.ids += ids

    def _hit(self, st: KVReq, ids: list[int], num_tokens: int) -> None:
        self.kv.add(_PREFIX_HIT, st.ref, ids, num_tokens=num_tokens)
        st.ids += ids

    def _cached(self, st: KVReq, request: Any, start: int, end: int, ids: list[int]) -> None:
        """CACHED for the blocks `ids`, the request's start-th to end-th, which vLLM had
        just hashed. One block after the known hashes (a decode step fills one for one
        request in block_size) gets a LazyHash, left to the encoding thread."""
        hashes = st.hashes
        if end == start + 1 and len(hashes) == start:
            tokens = getattr(request, "_all_token_ids", None) or request.all_token_ids
            bs = self.block_size
            parent = hashes[-1] if start else ROOT_HASH
            lazy = LazyHash(parent, tokens, start * bs, end * bs, self.pack_block)
            hashes.append(lazy)
            self.block_hash[ids[0]] = lazy
            kv = self.kv
            kv.kinds.append(_CACHED)  # KVEventLog.add, inlined
            kv.refs.append(st.ref)
            kv.sizes.append(1)
            kv.block_ids.append(ids[0])
            kv.cached_hashes.append(lazy)  # type: ignore[arg-type]
            return
        ours = self.block_hashes(st, request, end)
        new_hashes = list(map(short, ours[start:end]))
        self.block_hash.update(zip(ids, new_hashes))
        self.kv.add(_CACHED, st.ref, ids, new_hashes)

    def _freed(self, st: KVReq) -> None:
        if st.ids:
            ids, st.ids = st.ids, []
            ids.reverse()  # vLLM frees a table tail first
            self.kv.add(_FREED, st.ref, ids)

    def block_hashes(self, st: KVReq, request: Any, count: int) -> list[bytes | LazyHash]:
        """schedtop's hashes of the request's first `count` full blocks (or more)."""
        hashes = st.hashes
        if len(hashes) < count:
            # vLLM's own list, when it has one: its read-only view slices in Python.
            tokens = getattr(request, "_all_token_ids", None) or request.all_token_ids
            bs = self.block_size
            parent = whole(hashes[-1]) if hashes else ROOT_HASH
            for i in range(len(hashes), count):
                parent = hash_block(parent, list(tokens[i * bs : (i + 1) * bs]))
                hashes.append(parent)
        return hashes

    def prompt_hashes(self, st: KVReq, request: Any, count: int) -> list[bytes | LazyHash]:
        """`block_hashes` on the engine thread (a redacted arrival): after the operations
        so far, which also build a request's hashes."""
        self.run_ops()
        with self.ops_lock:
            return self.block_hashes(st, request, count)[:count]

    def _admission_failure(self, request: Any, n: int, num_hits: int, hits: Any) -> Reason:
        """Which admission test failed: the same three as schedtop's scheduler."""
        free = self.pool.get_num_free_blocks()
        hit_blocks = hits.blocks[0] if hits is not None and hits.blocks else []
        held = len(self._table(request.request_id))

        def needed(num_tokens: int) -> int:
            required = -(-num_tokens // self.block_size)
            fresh = max(required - held - len(hit_blocks), 0)
            return fresh + sum(1 for b in hit_blocks if b.ref_cnt == 0)

        max_len = self.config.max_model_len
        full = self.config.scheduler_reserve_full_isl
        return admission_failure(
            needed,
            free,
            min(num_hits + n, max_len),
            min(request.num_tokens, max_len) if full else None,
        )

    def on_reset_prefix_cache(self) -> None:
        """Every cached hash is dropped: EVICTED for each, as the reducer expects."""
        self.defer((self._reset, ()))

    def _reset(self) -> None:
        if self.block_hash:
            ids = sorted(self.block_hash)
            self.kv.add(_EVICTED, None, ids, _as_bytes([self.block_hash[b] for b in ids]))
            self.block_hash.clear()


def _as_bytes(hashes: list[bytes | LazyHash]) -> list[bytes]:
    """Hashes for the event log as they are: the encoder takes bytes() of a LazyHash."""
    return cast(list[bytes], hashes)
