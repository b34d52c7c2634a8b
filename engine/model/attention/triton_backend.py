# mypy: disable-error-code="no-untyped-def"
"""Paged attention as Triton kernels: the CUDA path.

Two kernels per layer. The first stores this step's K/V into their cache slots. The
second computes attention for every request in the batch at once, prefill chunks and
decodes alike: one program per (request, tile of BLOCK_M query tokens, KV head). The
program's rows are its tokens times the query heads that share the KV head (the GQA
group, padded to a power of two and masked, so a group of 3 runs as 4), and it walks the
request's block table one paged block at a time with an online softmax, masking keys
after each query's own position (causal) and past the sequence's end.

Under `TRITON_INTERPRET=1` the same kernels run on CPU tensors in Triton's interpreter
(the tests do this). The variable must be set before triton is first imported: Triton's
own library functions (tl.zeros, tl.max, ...) are wrapped for the interpreter then."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.attention.metadata import AttentionMetadata

MIN_DOT = 16  # tl.dot needs at least 16 rows, columns and depth on a GPU


@triton.jit  # type: ignore[untyped-decorator]
def _store_kv(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program per (new token, KV head): copy its K and V rows into its slot."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        d = tl.arange(0, HEAD_DIM_PAD)
        dmask = d < HEAD_DIM
        dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dmask)
        tl.store(k_cache_ptr + dst, k, mask=dmask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dmask)
        tl.store(v_cache_ptr + dst, v, mask=dmask)


@triton.jit  # type: ignore[untyped-decorator]
def _paged_attention(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (request, tile of BLOCK_M query tokens, KV head)."""
    r = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + r)
    q_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + r)
        context = seq_len - q_len
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        m = tile * BLOCK_M + rows // GROUP_PAD  # query token of each row, within the request
        g = rows % GROUP_PAD  # query head within the group
        row_ok = (m < q_len) & (g < GROUP)
        head = kvh * GROUP + g
        d = tl.arange(0, HEAD_DIM_PAD)
        dmask = d < HEAD_DIM
        q_off = (q_start + m)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dmask[None, :], other=0.0)
        q_pos = context + m  # absolute position: keys after it are masked
        keys_needed = tl.minimum(context + (tile + 1) * BLOCK_M, seq_len)
        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
        offs = tl.arange(0, BLOCK_SIZE)
        for j in range(0, (keys_needed + BLOCK_SIZE - 1) // BLOCK_SIZE):
            blk = tl.load(block_table_ptr + r * stride_bt + j).to(tl.int64)
            kv_off = blk * stride_cb + offs[:, None] * stride_cs + kvh * stride_ch + d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=dmask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            k_pos = j * BLOCK_SIZE + offs
            ok = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len) & row_ok[:, None]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + kv_off, mask=dmask[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q_start + m)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(
            out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :]
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def block_m_for(max_query_len: int, group_pad: int) -> int:
    """Query tokens per program: enough rows for tl.dot, no more than a prefill needs."""
    floor = max(1, MIN_DOT // group_pad)
    return max(floor, min(next_pow2(max_query_len), max(floor, 64 // group_pad)))


class TritonAttention:
    """Paged attention with the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.group_pad = next_pow2(self.group)
        self.head_dim_pad = max(MIN_DOT, next_pow2(head_dim))
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
        """q [T, Hq, D], k/v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]."""
        num_tokens = q.shape[0]
        block_size = k_cache.shape[1]
        if num_tokens:
            _store_kv[(num_tokens, self.num_kv_heads)](
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                k_cache.stride(2),
                block_size,
                HEAD_DIM=self.head_dim,
                HEAD_DIM_PAD=self.head_dim_pad,
            )
        out = torch.empty_like(q)
        block_m = block_m_for(meta.max_query_len, self.group_pad)
        grid = (meta.num_reqs, triton.cdiv(meta.max_query_len, block_m), self.num_kv_heads)
        table = meta.block_table
        _paged_attention[grid](
            q,
            k_cache,
            v_cache,
            out,
            table,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            table.stride(0),
            BLOCK_SIZE=block_size,
            GROUP=self.group,
            GROUP_PAD=self.group_pad,
            HEAD_DIM=self.head_dim,
            HEAD_DIM_PAD=self.head_dim_pad,
            BLOCK_M=block_m,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return out
