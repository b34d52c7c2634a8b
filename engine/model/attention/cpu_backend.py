"""Paged attention on the CPU with no dense copy of the cache: the C kernel
(csrc/paged_attention.c) reads each request's K/V blocks where they lie.

Decodes and short chunks go through the kernel, one row per query token (a decode is one
row); long prefill chunks stay on PyTorch's scaled_dot_product_attention, whose matrix
products beat a row-at-a-time kernel once a chunk has many tokens (bench/attention_bench.py
measures where). Anything the kernel does not cover (not fp32, not on the CPU, no C
compiler) runs through the PyTorch backend unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention import native
from engine.model.attention.metadata import AttentionMetadata
from engine.model.attention.torch_backend import Prefill, TorchAttention, plan_prefill, write_kv

# A request with at most this many query tokens is attended by the kernel, one row per
# token; longer chunks go to SDPA (bench/attention_bench.py --crossover: at 512 tokens of
# context the kernel is faster up to 8 query tokens, SDPA from 16 on).
KERNEL_MAX_QUERY = 8


@dataclass
class _RowPlan:
    """The kernel's rows for one step, longest first, shared by every layer."""

    rows: np.ndarray  # [N] int64: rows of q (and of the output)
    row_req: np.ndarray  # [N] int32: each row's request, a row of `table`
    row_len: np.ndarray  # [N] int32: keys each row sees (its position + 1)
    table: np.ndarray  # [R, max_blocks] int32, contiguous
    max_len: int  # the longest row_len
    prefills: list[Prefill]  # long chunks, for SDPA


class CpuPagedAttention:
    """The C kernel for decodes and short chunks, SDPA for long prefill chunks."""

    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.torch = TorchAttention(num_heads, num_kv_heads, head_dim)
        self.kernel = native.kernel()

    def covers(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether the kernel can run this call (else the PyTorch backend does)."""
        return (
            self.kernel is not None
            and q.device.type == "cpu"
            and q.dtype == torch.float32
            and k_cache.dtype == torch.float32
            and q.stride(-1) == 1
            and k_cache.is_contiguous()
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]."""
        if not (self.covers(q, k_cache) and v_cache.stride() == k_cache.stride()):
            return self.torch.forward(q, k, v, k_cache, v_cache, meta)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.plan.get("cpu")
        if plan is None:
            plan = meta.plan["cpu"] = self._plan(meta, k_cache.shape[1], q.device)
        out = torch.empty_like(q)
        if len(plan.rows):
            self._run_kernel(q, k_cache, v_cache, out, plan)
        for p in plan.prefills:
            out[p.start : p.end] = self.torch.prefill(q, k, v, k_cache, v_cache, p)
        return out

    def _plan(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> _RowPlan:
        qsl = meta.query_start_loc_cpu.astype(np.int64)
        q_lens = np.diff(qsl)
        seq_lens = meta.seq_lens_cpu.astype(np.int64)
        table = meta.block_table_cpu
        if table is None:
            table = meta.block_table.cpu().numpy()
        table = np.ascontiguousarray(table, dtype=np.int32)
        short = np.flatnonzero(q_lens <= KERNEL_MAX_QUERY)
        reqs = np.repeat(short, q_lens[short])
        # row i of request r is query token i: it sees its context and tokens 0..i
        first = np.repeat(qsl[short], q_lens[short])
        rows = first + _ranks(q_lens[short])
        row_len = seq_lens[reqs] - (qsl[reqs + 1] - rows) + 1
        order = np.argsort(-row_len, kind="stable")
        prefills = [
            plan_prefill(int(r), qsl, seq_lens, table, block_size, device)
            for r in np.flatnonzero(q_lens > KERNEL_MAX_QUERY)
        ]
        return _RowPlan(
            rows=np.ascontiguousarray(rows[order], dtype=np.int64),
            row_req=np.ascontiguousarray(reqs[order], dtype=np.int32),
            row_len=np.ascontiguousarray(row_len[order], dtype=np.int32),
            table=table,
            max_len=int(row_len.max(initial=1)),
            prefills=prefills,
        )

    def _run_kernel(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        plan: _RowPlan,
    ) -> None:
        assert self.kernel is not None
        rc = self.kernel(
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            plan.table.ctypes.data,
            plan.table.shape[1],
            plan.rows.ctypes.data,
            plan.row_req.ctypes.data,
            plan.row_len.ctypes.data,
            len(plan.rows),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            k_cache.shape[1],
            self.scale,
            plan.max_len,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("paged attention kernel: out of memory for its scratch buffers")


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for every n in lengths, concatenated."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    ranks: np.ndarray = np.arange(total) - starts
    return ranks
