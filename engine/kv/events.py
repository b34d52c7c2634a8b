"""The engine's log of a step's KV events: every block movement, with the request refs
and block ids that vLLM's own KV events leave out. A reducer that applies them in order
rebuilds the block map. The event kinds and records are engine.records' KVKind, KVEvent
and KVEvents (the log frozen at the end of the step)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from engine.records import NO_KV_EVENTS, KVEvent, KVEvents, KVKind

_CACHED, _EVICTED, _PREFIX_HIT = KVKind.CACHED, KVKind.EVICTED, KVKind.PREFIX_HIT


class KVEventLog:
    """A step's KV events as they happen, kept as columns.

    Appending is a few list operations with no object per event (the scheduler emits tens
    of events per step); `freeze` hands the columns over as the step's KVEvents record.
    Iterating yields KVEvent records, in order, EVICTED ones with the hashes they lost."""

    __slots__ = (
        "kinds",
        "refs",
        "sizes",
        "block_ids",
        "cached_hashes",
        "evicted_hashes",
        "hit_tokens",
    )

    def __init__(self) -> None:
        self.kinds: list[KVKind] = []  # one per event
        self.refs: list[int] = []  # one per event but EVICTED: whose table changed
        self.sizes: list[int] = []  # blocks per event
        self.block_ids: list[int] = []  # every event's blocks, back to back
        # the hashes of CACHED events, back to back, cut to the records' HASH_BYTES by
        # whoever adds them (the engine's block hasher cuts each once, when it hashes it)
        self.cached_hashes: list[bytes] = []
        self.evicted_hashes: list[bytes] = []  # the dropped hashes of EVICTED events
        self.hit_tokens: list[int] = []  # one per PREFIX_HIT: tokens covered

    def add(
        self,
        kind: KVKind,
        ref: int | None,
        block_ids: Iterable[int],
        hashes: Iterable[bytes] = (),
        num_tokens: int = 0,
    ) -> None:
        n = len(self.block_ids)
        self.block_ids.extend(block_ids)
        self.sizes.append(len(self.block_ids) - n)
        self.kinds.append(kind)
        if kind is _EVICTED:
            self.evicted_hashes.extend(hashes)
            return
        assert ref is not None, "only EVICTED events have no request"
        self.refs.append(ref)
        if kind is _CACHED:
            self.cached_hashes.extend(hashes)
        elif kind is _PREFIX_HIT:
            self.hit_tokens.append(num_tokens)

    def add_one(self, kind: KVKind, ref: int, block_id: int, cached_hash: bytes = b"") -> None:
        """add() for one block of a request (not EVICTED, not PREFIX_HIT): a decode's new
        block or its filled one, without add's list walks and tests. `cached_hash`, the
        cut hash, only for CACHED."""
        self.block_ids.append(block_id)
        self.sizes.append(1)
        self.kinds.append(kind)
        self.refs.append(ref)
        if kind is _CACHED:
            self.cached_hashes.append(cached_hash)

    def extend(self, other: KVEventLog) -> None:
        """Append another log's events, in order."""
        self.kinds += other.kinds
        self.refs += other.refs
        self.sizes += other.sizes
        self.block_ids += other.block_ids
        self.cached_hashes += other.cached_hashes
        self.evicted_hashes += other.evicted_hashes
        self.hit_tokens += other.hit_tokens

    def freeze(self) -> KVEvents:
        """The step's record (evicted hashes are left out: a reducer knows them)."""
        if not self.kinds:
            return NO_KV_EVENTS
        return KVEvents(
            tuple(self.kinds),
            tuple(self.refs),
            tuple(self.sizes),
            tuple(self.block_ids),
            tuple(self.cached_hashes),
            tuple(self.hit_tokens),
        )

    def __len__(self) -> int:
        return len(self.kinds)

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def __iter__(self) -> Iterator[KVEvent]:
        evicted = iter(self.evicted_hashes)
        for kind, ref, blocks, hashes, tokens in self.freeze().rows():
            if kind == _EVICTED:
                hashes = tuple(next(evicted) for _ in blocks)
            yield KVEvent(kind, ref, blocks, hashes, tokens)

    def __repr__(self) -> str:
        return f"KVEventLog({list(self)!r})"
