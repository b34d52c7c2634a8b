"""Random paged-attention problems and a naive oracle, shared by the attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention.metadata import AttentionMetadata, build_metadata


@dataclass
class Case:
    """One attention call: new tokens of several requests over a paged cache."""

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor  # [T, Hkv, D]
    k_cache: torch.Tensor  # [NB, BS, Hkv, D], context already in place
    v_cache: torch.Tensor
    query_lens: np.ndarray  # [R]
    context_lens: np.ndarray  # [R] tokens in the cache before this step
    block_table: np.ndarray  # [R, max_blocks]
    slot_mapping: np.ndarray  # [T]

    def metadata(self, device: torch.device | None = None) -> AttentionMetadata:
        return build_metadata(
            self.query_lens,
            self.query_lens + self.context_lens,
            self.block_table,
            self.slot_mapping,
            device or torch.device("cpu"),
        )

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_case(
    query_lens: list[int],
    context_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Blocks are handed out in a shuffled order so tables are not contiguous; block 0
    (the null block) stays zero and pads the tables."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    q_lens = np.array(query_lens, dtype=np.int64)
    ctx = np.array(context_lens, dtype=np.int64)
    seq = q_lens + ctx
    nbs = -(-seq // block_size)
    num_blocks = int(nbs.sum()) + 4
    order = rng.permutation(np.arange(1, num_blocks))
    table = np.zeros((len(q_lens), int(nbs.max())), dtype=np.int64)
    start = 0
    for i, n in enumerate(nbs):
        table[i, :n] = order[start : start + n]
        start += n
    slots = np.concatenate(
        [
            table[i, np.arange(ctx[i], seq[i]) // block_size] * block_size
            + np.arange(ctx[i], seq[i]) % block_size
            for i in range(len(q_lens))
        ]
    )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_cache[0] = 0
    v_cache[0] = 0
    t = int(q_lens.sum())
    heads = num_kv_heads * group
    return Case(
        torch.randn(t, heads, head_dim, generator=gen).to(dtype),
        torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype),
        torch.randn(t, num_kv_heads, head_dim, generator=gen).to(dtype),
        k_cache,
        v_cache,
        q_lens,
        ctx,
        table,
        slots,
    )


def naive_attention(case: Case) -> torch.Tensor:
    """Token by token, in float64: each query attends to its request's keys up to its own
    position, read slot by slot from the cache (context) or from this step (new)."""
    q = case.q.double()
    heads, kv_heads = q.shape[1], case.k.shape[1]
    group = heads // kv_heads
    bs = case.k_cache.shape[1]
    out = torch.zeros_like(q)
    row = 0
    for r, (n, ctx) in enumerate(zip(case.query_lens.tolist(), case.context_lens.tolist())):
        keys, values = [], []
        for pos in range(ctx):
            blk, off = case.block_table[r, pos // bs], pos % bs
            keys.append(case.k_cache[blk, off].double())
            values.append(case.v_cache[blk, off].double())
        for i in range(n):
            keys.append(case.k[row + i].double())
            values.append(case.v[row + i].double())
            kk = torch.stack(keys)  # [ctx + i + 1, Hkv, D]
            vv = torch.stack(values)
            for h in range(heads):
                s = kk[:, h // group] @ q[row + i, h] / q.shape[-1] ** 0.5
                out[row + i, h] = torch.softmax(s, 0) @ vv[:, h // group]
        row += n
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


# Shapes the kernel tests run: mixed prefill and decode, chunks that cross block
# boundaries, prefix-cached context, GQA group sizes 1, 3 and 4, block sizes 16 and 32.
SHAPES = [
    # (query_lens, context_lens, num_kv_heads, group, block_size)
    ([1, 1, 1], [5, 16, 40], 2, 3, 16),  # decodes only, one exactly at a block boundary
    ([7, 1, 20], [0, 33, 0], 2, 3, 16),  # prefills from scratch mixed with a decode
    ([12, 1, 9], [20, 47, 16], 1, 4, 16),  # chunks that cross block boundaries after context
    ([33, 1], [0, 64], 3, 1, 16),  # GQA 1 (multi-head), chunk longer than two blocks
    ([5, 1, 18], [32, 70, 3], 2, 4, 32),  # block size 32, prefix-cached context
    ([1, 40], [31, 32], 1, 3, 32),  # GQA 3 in blocks of 32, context ending on a boundary
]
