"""The pool of KV blocks: a free queue in LRU order, reference counts and the hash map.

Invariants (checked by `check_invariants`, and by the tests after every step):
- block 0 is the null block: never free, never owned, never cached;
- a block is in the free queue iff its ref_cnt is 0;
- every hash-map entry points to a block carrying that hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from engine.kv.events import KVEvent, KVEventKind


class KVBlock:
    """One block of `block_size` token slots. Free blocks are linked into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # block tables holding this block
        self.block_hash: bytes | None = None  # set once the block is full and cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) removal from the middle.

    The head is evicted (handed out) first. Sentinels at both ends keep every
    operation branch-free.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        node = self.head.next_free
        while node is not self.tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise ValueError(f"cannot take {n} blocks: only {self.num_free} free")
        out: list[KVBlock] = []
        node = self.head.next_free
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        assert node is not None
        self.head.next_free = node
        node.prev_free = self.head
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        last = self.tail.prev_free
        assert last is not None
        for block in blocks:
            block.prev_free = last
            last.next_free = block
            last = block
        last.next_free = self.tail
        self.tail.prev_free = last
        self.num_free += len(blocks)

    def prepend_n(self, blocks: list[KVBlock]) -> None:
        """Put `blocks` at the head, in list order (the first one is evicted first)."""
        first = self.head.next_free
        assert first is not None
        prev = self.head
        for block in blocks:
            block.prev_free = prev
            prev.next_free = block
            prev = block
        prev.next_free = first
        first.prev_free = prev
        self.num_free += len(blocks)


class BlockPool:
    """All KV blocks, the LRU free queue and the prefix-cache hash map.

    Events are appended to `events` as they happen; the owner drains the list.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.null_block = self.blocks[0]
        # hash -> blocks with that content, in caching order; the first one is served.
        self.cached: dict[bytes, dict[int, KVBlock]] = {}
        self.events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        entry = self.cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take `n` blocks from the head of the free queue, dropping their old hashes."""
        blocks = self.free_queue.popleft_n(n)
        evicted: list[KVBlock] = []
        for block in blocks:
            if block.block_hash is not None:
                evicted.append(block)
            block.ref_cnt = 1
        if evicted:
            self.events.append(KVEvent(KVEventKind.EVICTED, None,
                                       tuple(b.block_id for b in evicted),
                                       tuple(self._uncache(b) for b in evicted)))
        return blocks

    def _uncache(self, block: KVBlock) -> bytes:
        h = block.block_hash
        assert h is not None
        entry = self.cached[h]
        del entry[block.block_id]
        if not entry:
            del self.cached[h]
        block.block_hash = None
        return h

    def touch(self, blocks: list[KVBlock]) -> None:
        """A prefix hit: take a reference, pulling free cached blocks out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(self, request_id: str, blocks: list[KVBlock],
                          hashes: list[bytes]) -> None:
        for block, h in zip(blocks, hashes):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = h
            self.cached.setdefault(h, {})[block.block_id] = block
        self.events.append(KVEvent(KVEventKind.CACHED, request_id,
                                   tuple(b.block_id for b in blocks), tuple(hashes)))

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. Blocks reaching 0 go back to the queue:
        unhashed ones at the head (reused first), hashed ones at the tail (kept longest)."""
        first: list[KVBlock] = []
        last: list[KVBlock] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    first.append(block)
                else:
                    last.append(block)
        self.free_queue.prepend_n(first)
        self.free_queue.append_n(last)

    def check_invariants(self, tables: dict[str, list[KVBlock]]) -> None:
        """Raise AssertionError when the pool and the block tables disagree (K8)."""
        free_ids = [b.block_id for b in self.free_queue]
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
                f"{refs.get(block.block_id, 0)} tables hold it")
        assert len(free_set) + len(refs) == len(self.blocks) - 1, "free + owned != usable"
        for h, entry in self.cached.items():
            for bid, block in entry.items():
                assert block.block_id == bid and block.block_hash == h, (
                    f"hash map entry for block {bid} is stale")
