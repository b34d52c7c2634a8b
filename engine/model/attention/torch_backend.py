"""Paged attention in plain PyTorch: the CPU path, and the oracle for the Triton kernel.

New K/V go into their cache slots first; then every request attends to its whole sequence
(cached context plus this step's tokens) through its block table, causally. Decodes (one
query token) are batched, in a few groups of similar length to limit padding; prefill
chunks run one request at a time, since a step holds few of them. The per-step plan
(indices, masks) is built once and reused by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.attention.metadata import AttentionMetadata


@dataclass
class _Decodes:
    """Requests with one query token and similar lengths, attended to as one padded batch."""

    token_idx: torch.Tensor  # [B] rows of q that are decode tokens
    rows: torch.Tensor  # [B * Hkv * L] rows of the cache viewed as [slots * Hkv, D]
    length: int  # L: keys per request after padding (a multiple of block_size)
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 for keys in the sequence, -inf after


@dataclass
class Prefill:
    """One request with several query tokens."""

    start: int  # first row of q
    end: int  # one past its last row
    context: int  # tokens already in the cache before this step
    block_ids: torch.Tensor | None  # blocks to read when context > 0
    mask: torch.Tensor | None  # [q_len, seq_len] causal mask offset by the context


@dataclass
class _Plan:
    """One step's attention work, shared by every layer."""

    decodes: list[_Decodes]  # groups of decodes, each padded to its longest
    prefills: list[Prefill]  # requests with several query tokens, one by one


# Splitting decodes into groups of similar length saves padded keys but costs a few more
# operator calls per layer; a group costs about as much as this many padded keys.
GROUP_COST_TOKENS = 512
MAX_DECODE_GROUPS = 4
# A group's gathered K/V is read again by attention at once; in groups of at most this many
# requests it is still in cache (at 32 decodes and 512 keys, 8 per group is about 20%
# faster than one group of 32 on this project's 2-core machine).
MAX_GROUP_REQUESTS = 8


def decode_groups(lengths: np.ndarray, block_size: int) -> list[np.ndarray]:
    """Split decode requests (by index) into groups of similar length, at most
    MAX_GROUP_REQUESTS each, choosing the count (from the fewest possible up to
    MAX_DECODE_GROUPS more) that minimises padded keys plus a per-group cost."""
    order = np.argsort(lengths, kind="stable")
    padded = -(-lengths[order] // block_size) * block_size
    fewest = -(-len(order) // MAX_GROUP_REQUESTS)
    best: list[np.ndarray] = []
    best_cost = None
    for k in range(fewest, min(fewest + MAX_DECODE_GROUPS - 1, len(order)) + 1):
        parts = np.array_split(np.arange(len(order)), k)
        cost = sum(len(p) * int(padded[p[-1]]) for p in parts) + k * GROUP_COST_TOKENS
        if best_cost is None or cost < best_cost:
            best, best_cost = [order[p] for p in parts], cost
    return best


def plan_prefill(
    r: int,
    qsl: np.ndarray,
    seq_lens: np.ndarray,
    table: np.ndarray,
    block_size: int,
    device: torch.device,
) -> Prefill:
    """Request r's query rows, and what it reads from the cache when it has context."""
    start, end = int(qsl[r]), int(qsl[r + 1])
    seq_len = int(seq_lens[r])
    context = seq_len - (end - start)
    block_ids = mask = None
    if context > 0:
        nb = -(-seq_len // block_size)
        block_ids = torch.from_numpy(table[r, :nb].astype(np.int64)).to(device)
        rows = np.arange(context, seq_len)[:, None]
        mask = torch.from_numpy(np.arange(seq_len)[None, :] <= rows).to(device)
    return Prefill(start, end, context, block_ids, mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's keys and values [T, Hkv, D] into their slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttention:
    """Paged attention with torch operators; works on any device, fast enough on CPU."""

    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
        Returns [T, Hq, D]."""
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.plan.get("torch")
        if plan is None:
            plan = meta.plan["torch"] = self._plan(meta, k_cache.shape[1], q.device)
        out = torch.empty_like(q)
        for group in plan.decodes:
            out[group.token_idx] = self._decode(q, k_cache, v_cache, group)
        for p in plan.prefills:
            out[p.start : p.end] = self.prefill(q, k, v, k_cache, v_cache, p)
        return out

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _Plan:
        qsl = meta.query_start_loc_cpu
        q_lens = np.diff(qsl)
        seq_lens = meta.seq_lens_cpu
        table = meta.block_table_cpu
        if table is None:
            table = meta.block_table.cpu().numpy()
        decode_rows = np.flatnonzero(q_lens == 1)
        decodes = []
        if len(decode_rows):
            for group in decode_groups(seq_lens[decode_rows].astype(np.int64), block_size):
                decodes.append(
                    self._plan_decodes(qsl, seq_lens, table, decode_rows[group], block_size, device)
                )
        prefills = [
            plan_prefill(int(r), qsl, seq_lens, table, block_size, device)
            for r in np.flatnonzero(q_lens > 1)
        ]
        return _Plan(decodes, prefills)

    def _plan_decodes(
        self,
        qsl: np.ndarray,
        seq_lens: np.ndarray,
        table: np.ndarray,
        decode_rows: np.ndarray,
        block_size: int,
        device: torch.device,
    ) -> _Decodes:
        """Gather indices that lay each (request, KV head) out as a contiguous [L, D]
        run: attention then sees plain dense tensors, and the query heads of a group act
        as the query positions of one KV head (no GQA expansion)."""
        lens = seq_lens[decode_rows].astype(np.int64)
        nb = int(-(-lens.max() // block_size))
        length = nb * block_size
        slots = (
            table[decode_rows, :nb].astype(np.int64)[:, :, None] * block_size
            + np.arange(block_size)
        ).reshape(len(decode_rows), length)
        heads = np.arange(self.num_kv_heads)
        rows = slots[:, None, :] * self.num_kv_heads + heads[None, :, None]
        mask = np.where(np.arange(length)[None, :] < lens[:, None], 0.0, -np.inf)
        return _Decodes(
            token_idx=torch.from_numpy(qsl[decode_rows].astype(np.int64)).to(device),
            rows=torch.from_numpy(rows.reshape(-1)).to(device),
            length=length,
            mask=torch.from_numpy(mask.astype(np.float32))[:, None, None, :].to(device),
        )

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: _Decodes
    ) -> torch.Tensor:
        num_reqs = d.token_idx.shape[0]
        shape = (num_reqs, self.num_kv_heads, d.length, self.head_dim)
        keys = k_cache.view(-1, self.head_dim).index_select(0, d.rows).view(shape)
        values = v_cache.view(-1, self.head_dim).index_select(0, d.rows).view(shape)
        group = self.num_heads // self.num_kv_heads
        query = q.index_select(0, d.token_idx).view(
            num_reqs, self.num_kv_heads, group, self.head_dim
        )
        out = F.scaled_dot_product_attention(
            query, keys, values, attn_mask=d.mask.to(q.dtype), scale=self.scale
        )
        return out.reshape(num_reqs, self.num_heads, self.head_dim)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """[B * nb] block ids -> [B, Hkv, nb * block_size, D] (a strided view)."""
        flat = cache.view(cache.shape[0], -1).index_select(0, block_ids)
        return flat.view(num_reqs, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        p: Prefill,
    ) -> torch.Tensor:
        query = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if p.block_ids is None:
            # No context: this step's own keys are the whole sequence.
            keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            assert p.mask is not None
            seq_len = p.mask.shape[1]
            keys = self._gather(k_cache, p.block_ids, 1)[:, :, :seq_len]
            values = self._gather(v_cache, p.block_ids, 1)[:, :, :seq_len]
            out = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=p.mask, scale=self.scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)
