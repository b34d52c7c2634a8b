"""The free-block queue in LRU order, as two index arrays: O(1) removal from the middle,
and a copy is two memcpys, which keeps keyframes cheap."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator

_NONE = -1


class FreeQueue:
    """Free block ids, head (handed out first) to tail, for blocks 1..num_blocks-1.

    Invariant: block b is queued iff prev[b] != -1; `head` and `tail` are sentinels."""

    __slots__ = ("prev", "next", "head", "tail", "size")

    def __init__(self, num_blocks: int, blocks: Iterable[int] = ()) -> None:
        self.head = num_blocks
        self.tail = num_blocks + 1
        self.prev = array("q", [_NONE]) * (num_blocks + 2)
        self.next = array("q", [_NONE]) * (num_blocks + 2)
        self.size = 0
        self._link([self.head, *blocks, self.tail])

    def _link(self, chain: list[int]) -> None:
        """Link `chain` (head, blocks..., tail) in one tight loop: a snapshot's queue holds
        tens of thousands of blocks."""
        prev, nxt = self.prev, self.next
        for a, b in zip(chain, chain[1:]):
            nxt[a] = b
            prev[b] = a
        self.size = len(chain) - 2

    def copy(self) -> FreeQueue:
        twin = FreeQueue.__new__(FreeQueue)
        twin.prev, twin.next = self.prev[:], self.next[:]
        twin.head, twin.tail, twin.size = self.head, self.tail, self.size
        return twin

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self.head and self.prev[block] != _NONE

    def __iter__(self) -> Iterator[int]:
        return iter(self.first(self.size))

    def first(self, n: int) -> list[int]:
        """The first n blocks (fewer if the queue is shorter), without removing them."""
        out: list[int] = []
        nxt, tail = self.next, self.tail
        node = nxt[self.head]
        while node != tail and len(out) < n:  # n bounds it even if the links were bad
            out.append(node)
            node = nxt[node]
        return out

    def popleft_if(self, block: int) -> bool:
        """Remove the head if it is `block` (the one-block allocation, the common case);
        False, and nothing changed, if the head is another block."""
        nxt = self.next
        if nxt[self.head] != block or block == self.tail:
            return False
        after = nxt[block]
        nxt[self.head] = after
        self.prev[after] = self.head
        self.prev[block] = nxt[block] = _NONE
        self.size -= 1
        return True

    def popleft_n(self, n: int) -> list[int]:
        """Remove and return the first n blocks (fewer if the queue is shorter)."""
        out = self.first(n)
        if out:
            prev, nxt = self.prev, self.next
            after = nxt[out[-1]]
            nxt[self.head] = after
            prev[after] = self.head
            for block in out:
                prev[block] = nxt[block] = _NONE
            self.size -= len(out)
        return out

    def remove(self, block: int) -> None:
        prev, nxt = self.prev, self.next
        before, after = prev[block], nxt[block]
        nxt[before] = after
        prev[after] = before
        prev[block] = nxt[block] = _NONE
        self.size -= 1

    def append_n(self, blocks: Iterable[int]) -> None:
        prev, nxt = self.prev, self.next
        last = prev[self.tail]
        for block in blocks:
            prev[block] = last
            nxt[last] = block
            last = block
            self.size += 1
        nxt[last] = self.tail
        prev[self.tail] = last

    def prepend_n(self, blocks: list[int]) -> None:
        """Put `blocks` at the head in list order: blocks[0] is handed out first."""
        prev, nxt = self.prev, self.next
        first = nxt[self.head]
        before = self.head
        for block in blocks:
            prev[block] = before
            nxt[before] = block
            before = block
            self.size += 1
        nxt[before] = first
        prev[first] = before
