"""LazyHash: the block hashes recorder.vllm leaves to its encoding thread are schedtop's
own (engine.kv.hashing), whoever computes them first and in whatever order."""

from __future__ import annotations

import random
import struct
import sys
import threading

from engine.kv.hashing import ROOT_HASH, hash_block
from engine.records import HASH_BYTES, KVEvents, KVKind, Step
from recorder.codec import encode
from recorder.vllm.lazyhash import LazyHash, computed, short, whole

BS = 16
PACK = struct.Struct(f"<{BS}Q").pack


def chain(tokens: list[int], eager_every: int = 0) -> tuple[list[bytes | LazyHash], list[bytes]]:
    """Lazy hashes of `tokens`' full blocks (every `eager_every`-th one computed at once,
    as the recorder's slow path does), and the same computed by hash_block."""
    lazy: list[bytes | LazyHash] = []
    expected: list[bytes] = []
    parent: bytes = ROOT_HASH
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS : (i + 1) * BS])
        expected.append(parent)
        if eager_every and i % eager_every == 0:
            lazy.append(parent)
        else:
            lazy.append(
                LazyHash(lazy[-1] if lazy else ROOT_HASH, tokens, i * BS, (i + 1) * BS, PACK)
            )
    return lazy, expected


def test_lazy_hashes_equal_hash_block_in_any_order() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(200_000) for _ in range(BS * 40 + 5)]
    for eager_every in (0, 3):
        lazy, expected = chain(tokens, eager_every)
        order = list(range(len(lazy)))
        rng.shuffle(order)
        for i in order:
            assert whole(lazy[i]) == expected[i]
            assert short(lazy[i]) == expected[i][:HASH_BYTES]
            if isinstance(lazy[i], LazyHash):  # as the encoder takes it
                assert bytes(lazy[i]) == expected[i][:HASH_BYTES]


def test_a_computed_hash_lets_go_of_the_tokens() -> None:
    tokens = list(range(BS * 3))
    lazy, _ = chain(tokens)
    last = lazy[-1]
    assert isinstance(last, LazyHash)
    last.value()
    for h in lazy:
        assert isinstance(h, LazyHash)
        assert h.tokens is None and h.parent is None and h.whole is not None


def test_a_long_chain_does_not_recurse() -> None:
    tokens = [i % 50_000 for i in range(BS * 5000)]
    lazy, expected = chain(tokens)
    assert whole(lazy[-1]) == expected[-1]


def test_two_threads_computing_one_chain_agree() -> None:
    """The GIL switches threads every few microseconds here, so that the two meet
    mid-computation (one sees what the other left half done)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _two_threads()
    finally:
        sys.setswitchinterval(interval)


def _two_threads() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(50_000) for _ in range(BS * 3000)]
    for _ in range(3):
        lazy, expected = chain(tokens)
        got: dict[str, list[bytes]] = {}

        def compute(
            name: str,
            order: list[int],
            lazy: list[bytes | LazyHash] = lazy,
            got: dict[str, list[bytes]] = got,
        ) -> None:
            got[name] = [whole(lazy[i]) for i in order]

        forward, backward = list(range(len(lazy))), list(range(len(lazy)))[::-1]
        threads = [
            threading.Thread(target=compute, args=("f", forward)),
            threading.Thread(target=compute, args=("b", backward)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got["f"] == expected and got["b"] == expected[::-1]


def test_records_with_lazy_hashes_encode_as_with_bytes() -> None:
    tokens = list(range(1000, 1000 + BS * 4))
    lazy, expected = chain(tokens)
    cached = KVKind.CACHED
    with_lazy = KVEvents((cached,) * 4, (0,) * 4, (1,) * 4, (5, 6, 7, 8), tuple(lazy), ())  # type: ignore[arg-type]
    with_bytes = KVEvents(
        (cached,) * 4, (0,) * 4, (1,) * 4, (5, 6, 7, 8), tuple(h[:HASH_BYTES] for h in expected), ()
    )
    step = Step(step=3, kv_events=with_lazy)
    assert encode(step) == encode(Step(step=3, kv_events=with_bytes))
    assert computed(step) == Step(step=3, kv_events=with_bytes)
    plain = Step(step=4, kv_events=with_bytes)
    assert computed(plain) is plain
