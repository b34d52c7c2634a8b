"""The block pool and KV manager: LRU order, hits, eviction, all-or-nothing allocation."""

from __future__ import annotations

from engine.kv.block_pool import BlockPool
from engine.kv.events import KVKind
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
