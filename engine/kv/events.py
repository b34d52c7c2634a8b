"""KV-cache events: every block movement, with the request and block ids that vLLM's own
KV events leave out. A reducer that applies them in order rebuilds the block map."""

from __future__ import annotations

import enum
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
