"""Block hashes computed when first needed: a block that fills while vLLM decodes gets
schedtop's hash (engine.kv.hashing) as a LazyHash, which the recorder's encoding thread
computes when it writes the step, off vLLM's engine thread."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from engine.records import HASH_BYTES, Step


class LazyHash:
    """hash_block(parent, tokens[start:stop]), computed on first use and kept.

    `tokens` is the request's own token list, which vLLM only appends to (streaming
    sessions, which cut it, are not recorded): a full block's tokens never change.
    `bytes()` gives the hash as traces keep it. Thread-safe under the GIL: a computed
    hash is stored before `parent`, `tokens` and `pack` are let go, and `value` reads
    those before it looks for the hash, so it sees one or the other."""

    __slots__ = ("parent", "tokens", "start", "stop", "pack", "whole")

    def __init__(
        self,
        parent: bytes | LazyHash,
        tokens: Sequence[int],
        start: int,
        stop: int,
        pack: Callable[..., bytes],
    ) -> None:
        self.parent: Any = parent  # the previous block's hash (None once computed)
        self.tokens: Any = tokens  # the request's tokens (None once computed)
        self.start = start  # the block's first token
        self.stop = stop  # and the one after its last
        self.pack: Any = pack  # packs a block's token ids as hash_block does
        self.whole: bytes | None = None  # the hash, once computed

    def value(self) -> bytes:
        """The whole hash. A loop, not recursion: a long decode leaves a long chain."""
        whole = self.whole
        if whole is not None:
            return whole
        pending: list[tuple[LazyHash, Any, Any]] = []
        node = self
        while True:
            parent, tokens, pack = node.parent, node.tokens, node.pack
            whole = node.whole
            if whole is not None:
                break
            pending.append((node, tokens, pack))
            if type(parent) is bytes:
                whole = parent
                break
            node = parent
        sha256 = hashlib.sha256
        for node, tokens, pack in reversed(pending):
            whole = sha256(whole + pack(*tokens[node.start : node.stop])).digest()
            node.whole = whole
            node.parent = node.tokens = node.pack = None
        return whole

    def __bytes__(self) -> bytes:
        return self.value()[:HASH_BYTES]


def whole(h: bytes | LazyHash) -> bytes:
    """A whole hash, computed if it is lazy."""
    return h.value() if isinstance(h, LazyHash) else h


def short(h: bytes | LazyHash) -> bytes:
    """A whole hash as traces keep it."""
    return bytes(h) if isinstance(h, LazyHash) else h[:HASH_BYTES]


def computed(step: Step) -> Step:
    """`step` with its KV events built (recorder.vllm.kv.PendingKV) and their hashes all
    bytes (for those who read records in the engine's process, as tests do: a LazyHash
    compares by identity)."""
    events = step.kv_events
    get = getattr(events, "get", None)  # a PendingKV's (KVEvents has no `get`)
    if get is not None:
        events = get()
    if all(type(h) is bytes for h in events.hashes):
        return step if events is step.kv_events else replace(step, kv_events=events)
    return replace(step, kv_events=replace(events, hashes=tuple(map(bytes, events.hashes))))
