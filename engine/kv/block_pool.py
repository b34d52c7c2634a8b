"""The pool of KV blocks: a free queue in LRU order, reference counts and the hash map.

Invariants (checked by `check_invariants`, and by the tests after every step):
- block 0 is the null block: never free, never owned, never cached;
- a block is in the free queue iff its ref_cnt is 0;
- every hash-map entry points to a block carrying that hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import repeat

from engine.kv.events import KVEventLog
from engine.records import KVKind, trace_hashes

# Bound once: an enum member read through its class costs about 0.1 µs on Python 3.11
# (EnumType.__getattr__'s hook), and every allocation, cache and free names one.
_ALLOCATED, _CACHED, _EVICTED, _FREED = (
    KVKind.ALLOCATED,
    KVKind.CACHED,
    KVKind.EVICTED,
    KVKind.FREED,
)


class KVBlock:
    """One block of `block_size` token slots."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # block tables holding this block
        self.block_hash: bytes | None = None  # set once the block is full and cached
        # Its neighbours in the free queue; prev_free is None when it is not queued (and
        # next_free then means nothing: never None, so that walks need no test for it).
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock = self

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Free blocks in eviction order, head (handed out first) to tail.

    A doubly linked list through the blocks themselves, between two sentinel blocks: O(1)
    removal from the middle (a prefix hit on a free block), and a run of n blocks taken
    from the head or put at either end in one loop of a few attribute stores a block.
    (An OrderedDict keyed by block id did the same in C, but each pop and insert cost
    about 0.2 µs a block in node and hash-table upkeep: most of a prefill chunk's
    allocation, and of a finished request's free.) Walking it for a snapshot is a Python
    loop, about 30 ns a block."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = head = KVBlock(-1)
        self._tail = tail = KVBlock(-1)
        # The sentinels point at themselves outward, so no walk or removal meets a None.
        head.prev_free, head.next_free = head, tail
        tail.prev_free, tail.next_free = head, tail
        self.num_free = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        tail = self._tail
        block = self._head.next_free
        while block is not tail:
            yield block
            block = block.next_free

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None and block.block_id >= 0

    def ids(self) -> list[int]:
        """Free block ids, head to tail (a snapshot's; one tight walk, no generator)."""
        out: list[int] = []
        put = out.append
        block = self._head.next_free
        # A for loop, not `while block is not tail`: CPython 3.11 specializes a function's
        # code once it has looped a few times, but counts only unconditional backward
        # jumps, which a while loop's test does not make. A snapshot walks the queue
        # once, so the while loop ran unspecialized: 820 instructions a block, 343 now
        # (over `repeat`, whose item is no new int each time as a range's would be).
        for _ in repeat(None, self.num_free):
            put(block.block_id)
            block = block.next_free
        return out

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head, head first."""
        if n > self.num_free:
            raise ValueError(f"cannot take {n} blocks: only {self.num_free} free")
        head = self._head
        block = head.next_free
        blocks: list[KVBlock] = []
        for _ in range(n):
            blocks.append(block)
            block.prev_free = None
            block = block.next_free
        head.next_free = block
        block.prev_free = head
        self.num_free -= n
        return blocks

    def remove(self, block: KVBlock) -> None:
        before, after = block.prev_free, block.next_free
        if before is None or block.block_id < 0:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        before.next_free = after
        after.prev_free = before
        block.prev_free = None
        self.num_free -= 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Put `blocks` at the tail, in list order (the last one is evicted last)."""
        tail = self._tail
        last = tail.prev_free
        assert last is not None
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = tail
        tail.prev_free = last
        self.num_free += len(blocks)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put `blocks` at the head, in list order (the first one is evicted first)."""
        before = self._head
        first = before.next_free
        for block in blocks:
            before.next_free = block
            block.prev_free = before
            before = block
        before.next_free = first
        first.prev_free = before
        self.num_free += len(blocks)


class BlockPool:
    """All KV blocks, the LRU free queue and the prefix-cache hash map.

    Events are appended to `events` as they happen; the owner drains the list.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # Each cached block's hash as records keep it (trace_hashes), by block id; None
        # while the block holds no hash. Kept beside block_hash for snapshots: they list
        # every cached block, and picking them from this list (and their ids from
        # `block_ids`, the blocks' own ints) is two passes in C, where reading the
        # attribute off 17,000 blocks and cutting thousands of hashes cost a snapshot
        # about a millisecond (docs/benchmarks.md, Recorder).
        self.short_hashes: list[bytes | None] = [None] * num_blocks
        self.block_ids = [b.block_id for b in self.blocks]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # hash -> the block with that content, or (two requests computed the same block
        # before either was cached) a dict of the blocks, by id in caching order; the first
        # is served. One block, most of the time, needs no container of its own: a dict
        # per cached block outlived the young collections and grew the old generation by
        # a hundred objects a step, which set off full collections of the whole pool.
        self.cached: dict[bytes, KVBlock | dict[int, KVBlock]] = {}
        self.events = KVEventLog()

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        entry = self.cached.get(block_hash)
        if isinstance(entry, dict):
            return next(iter(entry.values()))
        return entry

    def cached_blocks(self) -> Iterator[tuple[bytes, KVBlock]]:
        """(hash, block) for every cached block, each hash's blocks in caching order."""
        for h, entry in self.cached.items():
            if isinstance(entry, dict):
                for block in entry.values():
                    yield h, block
            else:
                yield h, entry

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue, dropping their old hashes."""
        return self._take(n)[1]

    def allocate(self, ref: int, n: int) -> list[KVBlock]:
        """get_new_blocks for request `ref`, with its ALLOCATED event (after the EVICTED
        one, if any): a run of blocks in one call, its ids read in the same walk."""
        ids, blocks = self._take(n)
        self.events.add(_ALLOCATED, ref, ids)
        return blocks

    def allocate_one(self, ref: int) -> KVBlock:
        """allocate() of one block, without the run's lists and loop."""
        queue = self.free_queue
        if not queue.num_free:
            raise ValueError("cannot take 1 block: none free")
        head = queue._head
        block = head.next_free
        after = block.next_free
        head.next_free = after
        after.prev_free = head
        block.prev_free = None
        block.ref_cnt = 1
        queue.num_free -= 1
        if block.block_hash is not None:
            self.events.add(_EVICTED, None, [block.block_id], [self._uncache(block)])
        self.events.add_one(_ALLOCATED, ref, block.block_id)
        return block

    def _take(self, n: int) -> tuple[list[int], list[KVBlock]]:
        queue = self.free_queue
        if n > queue.num_free:
            raise ValueError(f"cannot take {n} blocks: only {queue.num_free} free")
        # FreeBlockQueue.popleft_n's walk, with each block's first reference and the
        # eviction test in the same pass: one loop a run, not two.
        head = queue._head
        block = head.next_free
        ids: list[int] = []
        blocks: list[KVBlock] = []
        evicted: list[KVBlock] = []
        for _ in range(n):
            ids.append(block.block_id)
            blocks.append(block)
            block.prev_free = None
            block.ref_cnt = 1
            if block.block_hash is not None:
                evicted.append(block)
            block = block.next_free
        head.next_free = block
        block.prev_free = head
        queue.num_free -= n
        if evicted:
            self.events.add(
                _EVICTED,
                None,
                [b.block_id for b in evicted],
                [self._uncache(b) for b in evicted],
            )
        return ids, blocks

    def _uncache(self, block: KVBlock) -> bytes:
        h = block.block_hash
        assert h is not None
        entry = self.cached[h]
        if isinstance(entry, dict):
            del entry[block.block_id]
            if len(entry) == 1:
                self.cached[h] = next(iter(entry.values()))
        else:
            del self.cached[h]
        block.block_hash = None
        self.short_hashes[block.block_id] = None
        return h

    def touch(self, blocks: list[KVBlock]) -> None:
        """A prefix hit: take a reference, pulling free cached blocks out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        ref: int,
        blocks: list[KVBlock],
        hashes: list[bytes],
        short: list[bytes] | None = None,
    ) -> None:
        """Register `blocks` under `hashes`, with their CACHED event, which carries the
        hashes cut to the records' length: `short` when the caller has them cut already."""
        # setdefault: one lookup of the hash for a new one (most), where get and a store
        # took two; a prefill chunk caches a block per 16 tokens.
        add = self.cached.setdefault
        shorts = self.short_hashes
        cut = trace_hashes(hashes) if short is None else short
        ids = []
        for block, h, s in zip(blocks, hashes, cut):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = h
            ids.append(block.block_id)
            shorts[block.block_id] = s
            entry = add(h, block)
            if entry is not block:  # the hash was there already
                self._share(h, entry, block)
        self.events.add(_CACHED, ref, ids, cut)

    def cache_block(self, ref: int, block: KVBlock, h: bytes, short: bytes) -> None:
        """cache_full_blocks for one block (`short`: its hash cut), without the run's
        slices and loop: a decode caches one block each time it fills one."""
        assert block.block_hash is None, f"block {block.block_id} is already cached"
        block.block_hash = h
        self.short_hashes[block.block_id] = short
        entry = self.cached.setdefault(h, block)
        if entry is not block:  # the hash was there already
            self._share(h, entry, block)
        self.events.add_one(_CACHED, ref, block.block_id, short)

    def _share(self, h: bytes, entry: KVBlock | dict[int, KVBlock], block: KVBlock) -> None:
        """`block` cached under `h` beside the block(s) `entry` already held there (rare:
        two requests filled the same content at once)."""
        if isinstance(entry, dict):
            entry[block.block_id] = block
        else:
            self.cached[h] = {entry.block_id: entry, block.block_id: block}

    def free_run(self, ref: int, ordered: list[KVBlock]) -> None:
        """Drop one reference from each block of request `ref`'s table, in the order
        given, with its FREED event. Blocks reaching 0 go back to the queue: unhashed ones
        at the head (reused first), hashed ones at the tail (kept longest). One walk reads
        the ids and links the hashed blocks at the tail as it goes; the unhashed ones go
        to the head after it."""
        queue = self.free_queue
        caching = self.enable_caching
        tail = queue._tail
        last = tail.prev_free
        assert last is not None
        ids: list[int] = []
        first: list[KVBlock] = []
        queued = 0
        for block in ordered:
            ids.append(block.block_id)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not caching:
                    first.append(block)
                else:
                    last.next_free = block
                    block.prev_free = last
                    last = block
                    queued += 1
        last.next_free = tail
        tail.prev_free = last
        queue.num_free += queued
        queue.prepend_n(first)
        self.events.add(_FREED, ref, ids)

    def check_invariants(self, tables: dict[str, list[KVBlock]]) -> None:
        """Raise AssertionError when the pool and the block tables disagree (K8)."""
        free_ids = self.free_queue.ids()
        free_set = set(free_ids)
        assert len(free_ids) == len(free_set), "a block is twice in the free queue"
        assert 0 not in free_set, "the null block is in the free queue"
        refs: dict[int, int] = {}
        for table in tables.values():
            for b in table:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert not (free_set & set(refs)), f"blocks both free and owned: {free_set & set(refs)}"
        for block in self.blocks[1:]:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{refs.get(block.block_id, 0)} tables hold it"
            )
        assert len(free_set) + len(refs) == len(self.blocks) - 1, "free + owned != usable"
        for h, entry in self.cached.items():
            if isinstance(entry, dict):
                assert len(entry) > 1, f"hash map entry {h.hex()[:8]} holds {len(entry)} blocks"
                for bid, block in entry.items():
                    assert block.block_id == bid, f"hash map entry for block {bid} is stale"
        for h, block in self.cached_blocks():
            assert block.block_hash == h, f"hash map entry for block {block.block_id} is stale"
        for block, short in zip(self.blocks, self.short_hashes):
            want = None if block.block_hash is None else trace_hashes([block.block_hash])[0]
            assert short == want, f"block {block.block_id}: its short hash is stale"
