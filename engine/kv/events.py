"""KV-cache events: every block movement, with the request and block ids that vLLM's own
KV events leave out. A reducer that applies them in order rebuilds the block map."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class KVEventKind(enum.IntEnum):
    ALLOCATED = 0  # fresh blocks appended to a request's table (taken from the free-queue head)
    FREED = 1  # a request's whole table released, tail-first; shared blocks just lose a ref
    PREFIX_HIT = 2  # cached blocks appended to a request's table (ref_cnt += 1)
    CACHED = 3  # full blocks of a request got their hash and became findable
    EVICTED = 4  # a free block was handed out again, so its hash was dropped


@dataclass(slots=True)  # not frozen: on the hot path, and frozen construction is 4x slower
class KVEvent:
    """One KV movement. Events are emitted in the order they happen."""

    kind: KVEventKind  # what happened
    request_id: str | None  # whose table changed; None for EVICTED
    block_ids: tuple[int, ...]  # the blocks, in table order (FREED: in freeing order)
    hashes: tuple[bytes, ...] = ()  # CACHED / EVICTED: each block's hash
    num_tokens: int = 0  # PREFIX_HIT: tokens covered by the hit


class KVEventLog:
    """A step's KV events, kept as columns.

    Appending is a few list operations with no object per event (the scheduler emits tens
    of events per step), and a recorder can take whole columns at once. Iterating yields
    KVEvent objects, in order."""

    __slots__ = (
        "kinds",
        "request_ids",
        "sizes",
        "block_ids",
        "cached_hashes",
        "evicted_hashes",
        "hit_tokens",
    )

    def __init__(self) -> None:
        self.kinds: list[KVEventKind] = []  # one per event
        self.request_ids: list[str | None] = []  # one per event; None for EVICTED
        self.sizes: list[int] = []  # blocks per event
        self.block_ids: list[int] = []  # every event's blocks, back to back
        self.cached_hashes: list[bytes] = []  # the hashes of CACHED events, back to back
        self.evicted_hashes: list[bytes] = []  # the dropped hashes of EVICTED events
        self.hit_tokens: list[int] = []  # one per PREFIX_HIT: tokens covered

    def add(
        self,
        kind: KVEventKind,
        request_id: str | None,
        block_ids: Iterable[int],
        hashes: Iterable[bytes] = (),
        num_tokens: int = 0,
    ) -> None:
        n = len(self.block_ids)
        self.block_ids.extend(block_ids)
        self.sizes.append(len(self.block_ids) - n)
        self.kinds.append(kind)
        self.request_ids.append(request_id)
        if kind is KVEventKind.CACHED:
            self.cached_hashes.extend(hashes)
        elif kind is KVEventKind.EVICTED:
            self.evicted_hashes.extend(hashes)
        elif kind is KVEventKind.PREFIX_HIT:
            self.hit_tokens.append(num_tokens)

    def __len__(self) -> int:
        return len(self.kinds)

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def __iter__(self) -> Iterator[KVEvent]:
        at = cached = evicted = hits = 0
        for kind, rid, size in zip(self.kinds, self.request_ids, self.sizes):
            blocks = tuple(self.block_ids[at : at + size])
            at += size
            hashes: tuple[bytes, ...] = ()
            tokens = 0
            if kind is KVEventKind.CACHED:
                hashes = tuple(self.cached_hashes[cached : cached + size])
                cached += size
            elif kind is KVEventKind.EVICTED:
                hashes = tuple(self.evicted_hashes[evicted : evicted + size])
                evicted += size
            elif kind is KVEventKind.PREFIX_HIT:
                tokens = self.hit_tokens[hits]
                hits += 1
            yield KVEvent(kind, rid, blocks, hashes, tokens)

    def __repr__(self) -> str:
        return f"KVEventLog({list(self)!r})"
