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
"""

from __future__ import annotations

import inspect
import struct
from collections.abc import Callable
from itertools import compress, repeat
from operator import itemgetter
from typing import Any, cast

from engine.config import EngineConfig
from engine.kv.events import KVEventLog
from engine.kv.hashing import ROOT_HASH, hash_block
from engine.records import KVKind, Reason
from engine.rules import admission_failure
from recorder.vllm.lazyhash import LazyHash, short, whole

# Outside schedule(); schedule() tapped per allocation; or not; recording has stopped; or
# not during the running pass, and per allocation from the waiting pass on.
IDLE, FULL, LEAN, STOPPED, MIXED = 0, 1, 2, 3, 4
_ALLOCATED, _CACHED, _EVICTED = KVKind.ALLOCATED, KVKind.CACHED, KVKind.EVICTED
_PREFIX_HIT, _FREED = KVKind.PREFIX_HIT, KVKind.FREED
_FIRST, _SECOND, _THIRD = itemgetter(0), itemgetter(1), itemgetter(2)
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
    """The KV side of one live request, as the recording sees it."""

    __slots__ = ("ref", "ids", "hashes", "cached")

    def __init__(self, ref: int) -> None:
        self.ref = ref  # the request's ref in the trace
        self.ids: list[int] = []  # its table's block ids (vLLM's table, mirrored from events)
        # schedtop's (whole) hashes of its full blocks, each the next's parent: they
        # outlive a preemption (the tokens stay); those of blocks filled while decoding
        # are computed when first needed
        self.hashes: list[bytes | LazyHash] = []
        self.cached = 0  # leading blocks of its table that are cached


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
        self.kv: KVEventLog = CutHashLog()
        self.mode = IDLE
        # block id -> its hash as traces keep it (or its LazyHash, of which bytes() is that)
        self.block_hash: dict[int, bytes | LazyHash] = {}
        # request id -> its blocks and hashes, from when it arrives until it finishes: one
        # lookup for a block that fills (a step has pushed most of them out of the caches)
        self.kvreqs: dict[str, KVReq] = {}
        self.refs: dict[str, int] = {}  # request id -> ref, until it finishes
        # LEAN: the blocks that filled, in order: (request, its blocks, first and end index
        # of the blocks that got hashes, blocks allocated in the step before then). The
        # allocations themselves are read off the SchedulerOutput.
        self.lean_order: list[tuple[Any, Any, int, int, int]] = []
        self.free_queue = self.pool.free_block_queue  # vLLM's; its count is an attribute
        self.lean_free = 0  # LEAN, MIXED: free blocks when schedule() began
        self.pass_blocks = 0  # MIXED: blocks the running pass allocated
        self.pre_kv: KVEventLog | None = None  # MIXED: the log up to the waiting pass
        self.raw_allocate: Any = None  # vLLM's allocate_slots
        self.tapped_allocate: Any = None  # the FULL-mode wrapper around it
        self.unwrapped = False  # vLLM's allocate_slots is in place, not the wrapper
        self.fill = self._filler()

    # -- installing --------------------------------------------------------------------------

    def install_kv(self) -> None:
        kvm, pool = self.kvm, self.pool
        free, cache_full = kvm.free, pool.cache_full_blocks
        lean_order = self.lean_order
        queue = self.free_queue
        kvreqs = self.kvreqs

        def on_filled(request: Any, blocks: Any, start: int, end: int) -> None:
            # vLLM calls cache_full_blocks only when a block of the request has filled:
            # its blocks[start:end] got hashes.
            mode = self.mode
            if mode in (LEAN, MIXED):  # logged after schedule(), with the owners
                lean_order.append(
                    (request, blocks, start, end, self.lean_free - queue.num_free_blocks)
                )
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
                # Blocks only leave the free queue by allocation in a LEAN schedule(): the
                # count says how many were allocated before this block filled.
                allocated = self.lean_free - queue.num_free_blocks
                lean_order.append((request, blocks, num_cached_blocks, num_full_blocks, allocated))
            else:
                on_filled(request, blocks, num_cached_blocks, num_full_blocks)

        def free_request(request: Any) -> None:
            if self.mode == STOPPED:
                free(request)
                return
            st = kvreqs.get(request.request_id)
            free(request)
            if st is not None and st.ids:
                ids, st.ids, st.cached = st.ids, [], 0
                ids.reverse()  # vLLM frees a table tail first
                self.kv.add(_FREED, st.ref, ids)

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
                    self._allocated(st, [b.block_id for b in new])
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

    # -- events ------------------------------------------------------------------------------

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

    def end_running_pass(self) -> None:
        """MIXED: the running pass is over (the waiting pass begins, or schedule() ends).
        What follows is tapped (FULL) and logged apart: it goes after the running pass's
        events, which only the SchedulerOutput will tell."""
        self.pass_blocks = self.lean_free - self.free_queue.num_free_blocks
        self.pre_kv, self.kv = self.kv, CutHashLog()
        self.set_mode(FULL)

    def mixed_events(self, out: Any) -> bool:
        """A MIXED schedule()'s KV events: what came before it, the running pass's (as in
        a LEAN step, from the SchedulerOutput's running requests, which come before the
        resumed ones), then the waiting pass's, as tapped."""
        if self.pre_kv is None:
            self.end_running_pass()  # no allocation for a waiting request
        assert self.pre_kv is not None
        waiting_pass, self.kv, self.pre_kv = self.kv, self.pre_kv, None
        cached_reqs = out.scheduled_cached_reqs
        m = len(cached_reqs.req_ids) - len(cached_reqs.resumed_req_ids)
        ok = self.lean_events(out, m, self.pass_blocks)
        self.kv.extend(waiting_pass)
        return ok

    def lean_events(self, out: Any, m: int | None = None, allocated: int | None = None) -> bool:
        """A LEAN schedule()'s KV events, in the order vLLM made them: the allocations, in
        scheduling order from the SchedulerOutput (each with the hashes it dropped), and
        between them each block that filled, after as many allocated blocks as had left
        the free queue when it filled. False if the blocks allocated do not add up (then
        the step cannot be recorded from the output). MIXED: only the first `m` cached
        requests (the running pass's), which allocated `allocated` blocks."""
        lean_order = self.lean_order
        cached_reqs = out.scheduled_cached_reqs
        new_ids = cached_reqs.new_block_ids
        req_ids = cached_reqs.req_ids
        if m is not None:
            new_ids, req_ids = new_ids[:m], req_ids[:m]
        if allocated is None:
            allocated = self.lean_free - self.free_queue.num_free_blocks
        if not allocated and new_ids.count(None) == len(new_ids):
            if not lean_order:  # most steps: no block allocated or filled
                return True
            fills = self.fill(lean_order)
            kv = self.kv
            if None not in fills:  # the common case: the columns in one go each
                k = len(fills)
                kv.kinds += repeat(_CACHED, k)
                kv.sizes += repeat(1, k)
                kv.refs += map(_FIRST, fills)
                kv.block_ids += map(_SECOND, fills)
                kv.cached_hashes += map(_THIRD, fills)
            else:
                for entry, done in zip(lean_order, fills):
                    self._log_fill(entry[0], done)
            lean_order.clear()
            return True
        fills = self.fill(lean_order) if lean_order else []
        kv = self.kv
        # None: no new blocks (most requests, most steps).
        owners = compress(zip(req_ids, new_ids), new_ids)
        block_hash, kvreqs = self.block_hash, self.kvreqs
        done = 0  # blocks whose allocation is logged
        fills.append(None)
        last = (None, None, 0, 0, allocated)  # the allocations after the last block filled
        for (request, _, _, _, before), filled in zip([*lean_order, last], fills):
            while done < before:
                owner = next(owners, None)
                if owner is None:
                    return False
                st, ids = kvreqs[owner[0]], owner[1][0]
                done += len(ids)
                if len(ids) != 1 or ids[0] in block_hash:  # not the one-block, hash-free case
                    self._allocated(st, ids)
                    continue
                kv.kinds.append(_ALLOCATED)  # KVEventLog.add, inlined
                kv.refs.append(st.ref)
                kv.sizes.append(1)
                kv.block_ids.append(ids[0])
                st.ids.append(ids[0])
            if request is not None:
                self._log_fill(request, filled)
        lean_order.clear()
        return done == allocated and next(owners, None) is None

    def _log_fill(self, request: Any, done: tuple[int, int, bytes] | None) -> None:
        """The CACHED event of one entry `fill` did (None: one it left to _on_cached)."""
        if done is None:
            self._on_cached(request)
            return
        kv = self.kv
        kv.kinds.append(_CACHED)  # KVEventLog.add, inlined
        kv.refs.append(done[0])
        kv.sizes.append(1)
        kv.block_ids.append(done[1])
        kv.cached_hashes.append(done[2])

    def _filler(self) -> Callable[[list[Any]], list[Any]]:
        """`fill(entries)`: for each (request, blocks, start, end, _) whose blocks[start:end]
        vLLM just hashed, schedtop's hash of the block as (ref, block id, its LazyHash),
        or None where the entry is not the common case (one block of a request whose
        earlier blocks are all known) and `_on_cached` must look at it. The state is
        updated; the caller logs the events in vLLM's order. One loop over a step's
        filled blocks, with the state bound once: a decode step fills a block for one
        request in block_size. The hashes are left to the encoding thread (LazyHash)."""
        pack, bs = self.pack_block, self.block_size
        kvreqs, block_hash = self.kvreqs, self.block_hash

        def fill(entries: list[Any]) -> list[Any]:
            out: list[Any] = []
            add = out.append
            for request, blocks, start, end, _ in entries:
                st = kvreqs.get(request.request_id)
                if (
                    st is None
                    or end != start + 1
                    or blocks is None
                    or st.cached != start
                    or len(st.hashes) != start
                    or end > len(blocks)
                ):
                    add(None)
                    continue
                hashes = st.hashes
                tokens = getattr(request, "_all_token_ids", None) or request.all_token_ids
                parent = hashes[-1] if start else ROOT_HASH
                lazy = LazyHash(parent, tokens, start * bs, end * bs, pack)
                hashes.append(lazy)
                block_id = blocks[start].block_id  # vLLM has just hashed it: in the cache
                block_hash[block_id] = lazy
                st.cached = end
                add((st.ref, block_id, lazy))
            return out

        return fill

    def filled(self, request: Any, blocks: list[Any] | None, start: int, end: int) -> None:
        """CACHED for blocks[start:end] of the request's table, which vLLM just hashed."""
        (done,) = self.fill([(request, blocks, start, end, 0)])
        self._log_fill(request, done)

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
            self.kv.add(_PREFIX_HIT, st.ref, hit_ids, num_tokens=num_hit_tokens)
            st.ids += hit_ids
            st.cached = before + len(hit_ids)
        new = table[before + len(hit_ids) :]
        if new:
            self._allocated(st, [b.block_id for b in new])
        self._on_cached(request)
        if step is not None:
            self._count_allocation(step, request, n, num_hit_tokens)

    def _on_cached(self, request: Any) -> None:
        """CACHED for the request's table blocks that got a hash since the last look."""
        rid = request.request_id
        table = self._table(rid)
        st = self.kvreqs[rid]
        done = st.cached
        end = done
        while end < len(table) and table[end].block_hash is not None:
            end += 1
        if end == done:
            return
        ours = self.block_hashes(request, end)
        ids = [b.block_id for b in table[done:end]]
        new_hashes = list(map(short, ours[done:end]))
        self.block_hash.update(zip(ids, new_hashes))
        self.kv.add(_CACHED, st.ref, ids, new_hashes)
        st.cached = end

    def block_hashes(self, request: Any, count: int) -> list[bytes | LazyHash]:
        """schedtop's hashes of the request's first `count` full blocks (or more)."""
        hashes = self.kvreqs[request.request_id].hashes
        if len(hashes) < count:
            # vLLM's own list, when it has one: its read-only view slices in Python.
            tokens = getattr(request, "_all_token_ids", None) or request.all_token_ids
            bs = self.block_size
            parent = whole(hashes[-1]) if hashes else ROOT_HASH
            for i in range(len(hashes), count):
                parent = hash_block(parent, list(tokens[i * bs : (i + 1) * bs]))
                hashes.append(parent)
        return hashes

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
        if self.block_hash:
            ids = sorted(self.block_hash)
            self.kv.add(_EVICTED, None, ids, _as_bytes([self.block_hash[b] for b in ids]))
            self.block_hash.clear()


def _as_bytes(hashes: list[bytes | LazyHash]) -> list[bytes]:
    """Hashes for the event log as they are: the encoder takes bytes() of a LazyHash."""
    return cast(list[bytes], hashes)
