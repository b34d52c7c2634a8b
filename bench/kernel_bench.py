"""The Triton paged-attention kernel against PyTorch's scaled_dot_product_attention on the
same shapes (SDPA gets dense, contiguous K/V: the best case for it), and the memory
bandwidth the kernel achieves in decode. Needs a CUDA GPU; exits with a message on CPU.

    .venv/bin/python bench/kernel_bench.py [--dtype bfloat16] [--iters 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, requests, query tokens each, context tokens each)
SHAPES = [
    ("decode b=1 ctx=4k", 1, 1, 4096),
    ("decode b=32 ctx=1k", 32, 1, 1024),
    ("decode b=64 ctx=2k", 64, 1, 2048),
    ("decode b=128 ctx=512", 128, 1, 512),
    ("prefill 4 x 512", 4, 512, 0),
    ("chunk 2 x 256 after 2k", 2, 256, 2048),
]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # a Llama-3-8B-like layer


def cuda_time(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def bench_shape(name: str, reqs: int, q_len: int, ctx: int, dtype: torch.dtype, iters: int) -> str:
    from engine.model.attention.metadata import build_metadata
    from engine.model.attention.triton_backend import TritonAttention

    dev = torch.device("cuda")
    seq = ctx + q_len
    nb = -(-seq // BLOCK)
    num_blocks = reqs * nb + 1
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = (1 + np.random.default_rng(0).permutation(reqs * nb)).reshape(reqs, nb)
    pos = np.arange(ctx, seq)
    slots = np.concatenate([table[r, pos // BLOCK] * BLOCK + pos % BLOCK for r in range(reqs)])
    meta = build_metadata(np.full(reqs, q_len), np.full(reqs, seq), table, slots, dev)
    t = reqs * q_len
    q = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    attn = TritonAttention(HEADS, KV_HEADS, HEAD_DIM)
    triton_s = cuda_time(lambda: attn.forward(q, k, v, k_cache, v_cache, meta), iters)
    kd = torch.randn(reqs, KV_HEADS, seq, HEAD_DIM, device=dev, dtype=dtype)
    vd = torch.randn_like(kd)
    qd = q.view(reqs, q_len, HEADS, HEAD_DIM).transpose(1, 2)
    causal = q_len > 1 and ctx == 0
    mask = None
    if q_len > 1 and ctx > 0:
        rows = ctx + torch.arange(q_len, device=dev)
        mask = torch.arange(seq, device=dev)[None, :] <= rows[:, None]
    sdpa_s = cuda_time(
        lambda: F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, is_causal=causal, enable_gqa=True
        ),
        iters,
    )
    kv_bytes = 2 * reqs * seq * KV_HEADS * HEAD_DIM * k_cache.element_size()
    bw = f"{kv_bytes / triton_s / 1e9:.0f}" if q_len == 1 else "-"
    return (
        f"| {name} | {triton_s * 1e6:.0f} | {sdpa_s * 1e6:.0f} | {sdpa_s / triton_s:.2f}x | {bw} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(
            "kernel_bench: needs a CUDA GPU (the Triton kernel's fast path); nothing to "
            "measure on this machine."
        )
        return 0
    dtype = getattr(torch, args.dtype)
    print(
        f"{torch.cuda.get_device_name()}, {args.dtype}, {HEADS} query heads, {KV_HEADS} KV "
        f"heads, head_dim {HEAD_DIM}, block {BLOCK}\n"
    )
    print("| shape | Triton paged µs | SDPA dense µs | SDPA / Triton | decode KV GB/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for shape in SHAPES:
        print(bench_shape(*shape, dtype=dtype, iters=args.iters), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
