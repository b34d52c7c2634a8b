"""The block pool and KV manager: LRU order, hits, eviction, all-or-nothing allocation."""

from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.events import KVEventLog, KVKind
from engine.kv.hashing import BlockHasher
from engine.kv.manager import KVCacheManager
from engine.request import Request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def make_req(rid: str, tokens: list[int], bs: int = 4) -> Request:
    return Request(rid, tokens, block_hasher=BlockHasher(bs))


def test_null_block_is_never_free_and_queue_starts_in_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5


def test_allocation_takes_from_the_head() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    assert free_ids(pool) == [3, 4, 5]


def test_free_is_tail_first_full_blocks_to_tail_partial_to_head() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=8, max_model_len=100)
    r = make_req("r", list(range(10)))  # blocks: [0..3] full, [4..7] full, [8, 9] partial
    r.status = r.status.WAITING
    assert kv.allocate_slots(r, 10) is not None
    assert kv.get_block_ids("r") == [1, 2, 3]
    kv.free(r)
    # The partial block 3 goes to the head (reused first); the full blocks go to the tail,
    # walked tail-first: 2 before 1, so block 1 (the prefix's root) is kept longest.
    assert free_ids(kv.pool) == [3, 4, 5, 6, 7, 2, 1]
    freed = [e for e in kv.take_events() if e.kind == KVKind.FREED][0]
    assert freed.block_ids == (3, 2, 1)


def test_prefix_hits_are_full_blocks_capped_at_num_tokens_minus_one() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=10, max_model_len=100)
    a = make_req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    # An identical 8-token prompt ends on a block boundary: the hit stops one block short,
    # so the last block is recomputed and the last token's logits exist.
    b = make_req("b", list(range(8)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [h.block_id for h in hits] == [1]
    c = make_req("c", list(range(9)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 8 and [h.block_id for h in hits] == [1, 2]


def test_hit_on_a_free_cached_block_takes_it_out_of_the_queue() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=6, max_model_len=100)
    a = make_req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert 1 in free_ids(kv.pool) and kv.pool.blocks[1].block_hash is not None
    b = make_req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    before = kv.num_free_blocks
    new = kv.allocate_slots(b, 1, n, hits)
    assert new is not None and len(new) == 1
    assert 1 not in free_ids(kv.pool) and 2 not in free_ids(kv.pool)
    assert kv.pool.blocks[1].ref_cnt == 1
    assert kv.num_free_blocks == before - 3  # two hits pulled out of the queue, one new
    kv.check_invariants()


def test_eviction_drops_the_hash() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=4, max_model_len=100)
    a = make_req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    kv.free(a)
    assert len(kv.pool.cached) == 3
    b = make_req("b", list(range(100, 112)))
    kv.allocate_slots(b, 12)  # takes every block: each cached one is evicted
    assert all(h not in kv.pool.cached for h in a.block_hashes)
    evicted = [e for e in kv.take_events() if e.kind == KVKind.EVICTED]
    assert sorted(sum((e.block_ids for e in evicted), ())) == [1, 2, 3]
    assert kv.get_computed_blocks(make_req("c", list(range(12))))[1] == 0
    kv.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=4, max_model_len=100)
    a = make_req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    b = make_req("b", list(range(50, 58)))
    events_before = list(kv.events)
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids("b") == [] and kv.num_free_blocks == 1
    assert list(kv.events) == events_before
    kv.check_invariants()


def test_shared_blocks_count_every_table() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=10, max_model_len=100)
    a = make_req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    b = make_req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1, n, hits)
    assert kv.pool.blocks[1].ref_cnt == 2
    kv.free(a)
    assert kv.pool.blocks[1].ref_cnt == 1 and 1 not in free_ids(kv.pool)
    kv.check_invariants()


def test_watermark_applies_only_when_admitting_beside_running_requests() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=10, max_model_len=100, watermark_blocks=3)
    r = make_req("r", list(range(36)))  # 9 blocks = every usable block
    assert kv.allocate_slots(r, 36, has_scheduled_reqs=True) is None
    assert kv.allocate_slots(r, 36, has_scheduled_reqs=False) is not None


def _cached_pool() -> BlockPool:
    """A pool whose head block (1) holds a cached hash, the next one (2) none."""
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.allocate(0, 2)
    pool.cache_full_blocks(0, blocks[:1], [b"h" * 32])
    pool.free_run(0, blocks[::-1])
    pool.free_queue.remove(blocks[0])  # the cached block went to the tail; put it first
    pool.free_queue.prepend_n([blocks[0]])
    pool.events = KVEventLog()
    return pool


def test_allocate_one_is_allocate_of_one_block_evicting_first() -> None:
    one, run = _cached_pool(), _cached_pool()
    got = one.allocate_one(7)
    assert [got.block_id] == [b.block_id for b in run.allocate(7, 1)]
    assert got.block_id == 1 and got.ref_cnt == 1 and got.block_hash is None
    assert list(one.events) == list(run.events)
    assert [e.kind for e in one.events] == [KVKind.EVICTED, KVKind.ALLOCATED]
    assert b"h" * 32 not in one.cached and free_ids(one) == free_ids(run)


def test_cache_block_is_cache_full_blocks_of_one() -> None:
    one, run = BlockPool(4, enable_caching=True), BlockPool(4, enable_caching=True)
    for pool in (one, run):
        pool.allocate(0, 3)
        pool.events = KVEventLog()
    h = bytes(range(32))
    one.cache_block(5, one.blocks[1], h, h[:8])
    run.cache_full_blocks(5, [run.blocks[1]], [h])
    assert list(one.events) == list(run.events)
    # The same hash again (two requests computed one block): both blocks are kept.
    one.cache_block(5, one.blocks[2], h, h[:8])
    run.cache_full_blocks(5, [run.blocks[2]], [h])
    assert list(one.events) == list(run.events)
    assert [b.block_id for _, b in one.cached_blocks()] == [1, 2]


def test_cached_events_carry_cut_hashes_whoever_hashed_the_blocks() -> None:
    """BlockHasher cuts each hash once; a hasher that keeps only block_hashes (a replay's)
    gets them cut by the manager: the CACHED events are the same."""

    def whole_only(req: Request) -> None:
        BlockHasher(4)(req)
        req.short_hashes.clear()

    logs = []
    for hasher in (BlockHasher(4), whole_only):
        kv = KVCacheManager(block_size=4, num_blocks=10, max_model_len=100)
        r = Request("r", list(range(15)), block_hasher=hasher)
        kv.allocate_slots(r, 15)
        r.num_computed_tokens = 15
        r.append_output_token_ids(99)  # fills block 4, hashed by the same hasher
        kv.allocate_running(r, 1)
        logs.append([(e.kind, e.block_ids, e.hashes) for e in kv.take_events()])
    cached = [h for kind, _, hs in logs[0] if kind == KVKind.CACHED for h in hs]
    assert len(cached) == 4 and all(len(h) == 8 for h in cached)
    assert logs[0] == logs[1]


def test_short_hashes_follow_caching_and_eviction_block_by_block() -> None:
    """A snapshot lists cached blocks from BlockPool.short_hashes: it must hold a block's
    cut hash exactly while the block holds its whole one, whichever call cached it and
    whichever evicted it."""
    kv = KVCacheManager(block_size=4, num_blocks=5, max_model_len=100)
    pool = kv.pool
    a = make_req("a", list(range(12)))
    kv.allocate_slots(a, 12)  # blocks 1-3, cached in one run
    assert pool.short_hashes == [None, *(h[:8] for h in a.block_hashes), None]
    pool.cache_block(0, pool.blocks[4], b"\x07" * 32, b"\x07" * 8)  # one block, alone
    assert pool.short_hashes[4] == b"\x07" * 8
    kv.free(a)
    b = make_req("b", list(range(100, 108)))
    kv.allocate_slots(b, 8)  # two blocks from the head: each evicted first
    evicted = [i for e in kv.take_events() if e.kind == KVKind.EVICTED for i in e.block_ids]
    assert evicted and all(pool.short_hashes[i] != a.block_hashes[0][:8] for i in evicted)
    for block, short in zip(pool.blocks, pool.short_hashes):
        assert short == (None if block.block_hash is None else block.block_hash[:8])
    kv.check_invariants()
