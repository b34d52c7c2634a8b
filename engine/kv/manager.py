"""The KV cache manager: per-request block tables on top of the block pool.

`allocate_slots` is all or nothing: it returns the new blocks, or None and changes
nothing. The test it applies (K3) is: new blocks + prefix-hit blocks that are currently
free (+ the watermark when admitting) <= free blocks.
"""

from __future__ import annotations

from engine.kv.block_pool import BlockPool, KVBlock
from engine.kv.events import KVEventLog
from engine.records import KVKind, trace_hashes
from engine.request import Request, Status


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _short_hashes(request: Request, done: int, full: int) -> list[bytes]:
    """Blocks done..full's hashes as their CACHED event carries them: BlockHasher cut them
    when it hashed them; hashes it did not make (another hasher's) are cut here, once."""
    short = request.short_hashes
    if len(short) < full:
        short += trace_hashes(request.block_hashes[len(short) : full])
    return short[done:full]


NO_BLOCKS: list[KVBlock] = []  # shared "nothing allocated" result; never mutated
# Bound once (an enum member read through its class is slow on Python 3.11).
_QUEUED = (Status.WAITING, Status.PREEMPTED)
_PREFIX_HIT = KVKind.PREFIX_HIT


class KVCacheManager:
    """Block tables for requests, prefix-cache lookup and the admission arithmetic."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.watermark_blocks = watermark_blocks
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks already in the hash map
        # The lookahead slots the scheduler asks allocate_running for (it sets this): part
        # of each request's kv_quiet, the threshold below which that call does nothing.
        self.num_lookahead_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def events(self) -> KVEventLog:
        return self.pool.events

    def take_events(self) -> KVEventLog:
        events, self.pool.events = self.pool.events, KVEventLog()
        return events

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks from the start of the request.

        Capped at `num_tokens - 1` tokens: the last token is always computed, to get
        logits, so a fully cached prompt ending on a block boundary recomputes its last
        block (K7)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        get = self.pool.get_cached_block
        for h in request.block_hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def blocks_needed(self, request: Request, num_tokens: int, new_computed: list[KVBlock]) -> int:
        """Free blocks that giving `request` room for `num_tokens` tokens would consume."""
        held = self.req_to_blocks.get(request.request_id)
        num_held = len(held) if held else 0
        required = cdiv(num_tokens, self.block_size)
        if not new_computed:
            return max(required - num_held, 0)
        new = max(required - num_held - len(new_computed), 0)
        # A hit on a free cached block pulls it out of the free queue.
        return new + sum(1 for b in new_computed if b.ref_cnt == 0)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> list[KVBlock] | None:
        """Give `request` slots for `num_new_tokens` more tokens (plus lookahead slots).

        Returns the newly allocated blocks, or None (nothing changed) when they do not fit.
        `new_computed` are prefix-hit blocks found by `get_computed_blocks` for a request
        being admitted; they are appended to its table first.
        """
        new_computed = new_computed or []
        num_computed = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        watermark = 0
        if has_scheduled_reqs and request.status in _QUEUED:
            watermark = self.watermark_blocks
        free = self.pool.num_free_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if self.blocks_needed(request, full, new_computed) + watermark > free:
                return None
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if self.blocks_needed(request, num_slots, new_computed) + watermark > free:
            return None

        rid = request.request_id
        table = self.req_to_blocks.setdefault(rid, [])
        if new_computed:
            self.pool.touch(new_computed)
            table.extend(new_computed)
            self.num_cached_block[rid] = len(table)
            self.pool.events.add(
                _PREFIX_HIT,
                request.ref,
                [b.block_id for b in new_computed],
                num_tokens=num_new_computed_tokens,
            )
        num_new_blocks = cdiv(num_slots, self.block_size) - len(table)
        new_blocks: list[KVBlock] = []
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(request.ref, num_new_blocks)
            table.extend(new_blocks)
        if self.enable_caching:
            # Draft tokens may be rejected, so cache only up to the known tokens.
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        self._set_quiet(request, table)
        return new_blocks

    def _set_quiet(self, request: Request, table: list[KVBlock]) -> None:
        """Keep `request.kv_quiet`: the most tokens (computed + new) for which
        allocate_running finds room in the table and no block to hash, so that the
        scheduler can skip that call for a steady decode (most steps of most requests)."""
        bs = self.block_size
        quiet = len(table) * bs - self.num_lookahead_tokens
        if self.enable_caching:
            filled = (self.num_cached_block.get(request.request_id, 0) + 1) * bs - 1
            if filled < quiet:
                quiet = filled
        request.kv_quiet = quiet

    def allocate_running(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVBlock] | None:
        """`allocate_slots` for a request that is already running: it has no new prefix
        hits, no watermark and no admission check, so the same decision takes far less
        work. This runs for every running request every step."""
        rid = request.request_id
        table = self.req_to_blocks[rid]
        bs = self.block_size
        computed = request.num_computed_tokens
        slots = computed + num_new_tokens + num_lookahead_tokens
        if slots > self.max_model_len:
            slots = self.max_model_len
        need = (slots + bs - 1) // bs - len(table)
        new_blocks = NO_BLOCKS
        if need > 0:
            pool = self.pool
            if need > pool.free_queue.num_free:
                return None
            if need == 1:  # a decode's next block (most calls that allocate)
                block = pool.allocate_one(request.ref)
                table.append(block)
                new_blocks = [block]
            else:
                new_blocks = pool.allocate(request.ref, need)
                table.extend(new_blocks)
        quiet = len(table) * bs - self.num_lookahead_tokens
        if self.enable_caching:
            # cache_blocks and _set_quiet, inlined: a decode comes here each time it fills
            # a block, and each time it needs a new one.
            upto = computed + num_new_tokens
            known = len(request.all_token_ids)
            if upto > known:
                upto = known
            done = self.num_cached_block.get(rid, 0)
            full = upto // bs
            if full > done:
                hashes = request.block_hashes
                if full > len(hashes):
                    full = len(hashes)
                if full == done + 1:  # a decode that filled its last block (most calls)
                    short = request.short_hashes
                    if len(short) < full:
                        _short_hashes(request, done, full)  # extends `short`
                    self.pool.cache_block(request.ref, table[done], hashes[done], short[done])
                    self.num_cached_block[rid] = done = full
                elif full > done:
                    self.pool.cache_full_blocks(
                        request.ref,
                        table[done:full],
                        hashes[done:full],
                        _short_hashes(request, done, full),
                    )
                    self.num_cached_block[rid] = done = full
            filled = (done + 1) * bs - 1
            if filled < quiet:
                quiet = filled
        request.kv_quiet = quiet
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash-register every block that `num_tokens` scheduled tokens fill (K4).

        A no-op without prefix caching, as vLLM's KVCacheManager.cache_blocks: the async
        scheduler calls it for every sample that arrives, whatever the config, and a
        block hashed here would be kept as a cached block when freed (and so leave the
        free queue in another order than vLLM's)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self.num_cached_block.get(rid, 0)
        full = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if done >= full:
            return
        table = self.req_to_blocks[rid]
        self.pool.cache_full_blocks(
            request.ref,
            table[done:full],
            request.block_hashes[done:full],
            _short_hashes(request, done, full),
        )
        self.num_cached_block[rid] = full
        self._set_quiet(request, table)

    def free(self, request: Request) -> None:
        """Release the request's table, tail-first, so its last blocks are reused first."""
        rid = request.request_id
        table = self.req_to_blocks.pop(rid, None)
        self.num_cached_block.pop(rid, None)
        request.kv_quiet = -1
        if not table:
            return
        self.pool.free_run(request.ref, table[::-1])

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the pool with nothing else in it."""
        return cdiv(num_tokens, self.block_size) <= len(self.pool.blocks) - 1

    def check_invariants(self) -> None:
        self.pool.check_invariants(self.req_to_blocks)
