"""The Triton paged-attention kernel against PyTorch's scaled_dot_product_attention on the
same shapes (SDPA gets dense, contiguous K/V: the best case for it), and the memory
bandwidth the kernel reaches in decode, as a fraction of the GPU's HBM peak.

    .venv/bin/python bench/kernel_bench.py [--dtype bfloat16] [--iters 50] [--hbm-peak-gbs N]
    .venv/bin/python bench/kernel_bench.py --dry-run     # CPU: tiny shapes, Triton interpreted

On CPU it exits with a message, unless --dry-run: then tiny shapes run through the same
code under TRITON_INTERPRET=1 (the timings mean nothing; it checks the plumbing and that
the kernel agrees with SDPA). The peak comes from a table of known GPUs by name, or from
--hbm-peak-gbs."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (name, requests, query tokens each, context tokens each)
SHAPES = [
    ("decode b=1 ctx=4k", 1, 1, 4096),
    ("decode b=32 ctx=1k", 32, 1, 1024),
    ("decode b=64 ctx=2k", 64, 1, 2048),
    ("decode b=128 ctx=512", 128, 1, 512),
    ("decode b=256 ctx=4k", 256, 1, 4096),
    ("prefill 4 x 512", 4, 512, 0),
    ("chunk 2 x 256 after 2k", 2, 256, 2048),
]
DRY_SHAPES = [("decode b=2 ctx=40", 2, 1, 40), ("chunk 1 x 5 after 20", 1, 5, 20)]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # a Llama-3-8B-like layer
DRY_DIMS = (4, 2, 16, 16)
# HBM peak in GB/s (vendor figures), matched against torch.cuda.get_device_name()
HBM_PEAK_GBS = {
    "H200": 4800,
    "H100 SXM": 3350,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,
    "A100-SXM4-80GB": 2039,
    "A100 80GB PCIe": 1935,
    "A100": 1555,
    "L40S": 864,
    "L4": 300,
    "A10": 600,
    "RTX 4090": 1008,
}


def hbm_peak(name: str, given: float | None) -> float | None:
    if given:
        return given
    for key, gbs in HBM_PEAK_GBS.items():  # most specific first
        if key in name:
            return float(gbs)
    return None


def cuda_time(fn: Callable[[], Any], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # type: ignore[no-untyped-call]
        fn()
        end.record()  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)  # type: ignore[no-untyped-call]
    return statistics.median(times)


def host_time(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_shape(
    shape: tuple[str, int, int, int],
    dims: tuple[int, int, int, int],
    dtype: torch.dtype,
    dev: torch.device,
    iters: int,
    peak: float | None,
) -> str:
    from engine.model.attention.metadata import build_metadata
    from engine.model.attention.triton_backend import TritonAttention

    name, reqs, q_len, ctx = shape
    heads, kv_heads, head_dim, block = dims
    timer = cuda_time if dev.type == "cuda" else host_time
    seq = ctx + q_len
    nb = -(-seq // block)
    num_blocks = reqs * nb + 1
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    table = (1 + np.random.default_rng(0).permutation(reqs * nb)).reshape(reqs, nb)
    pos = np.arange(ctx, seq)
    slots = np.concatenate([table[r, pos // block] * block + pos % block for r in range(reqs)])
    meta = build_metadata(np.full(reqs, q_len), np.full(reqs, seq), table, slots, dev)
    t = reqs * q_len
    q = torch.randn(t, heads, head_dim, device=dev, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    attn = TritonAttention(heads, kv_heads, head_dim)
    got = attn.forward(q, k, v, k_cache, v_cache, meta)
    triton_s = timer(lambda: attn.forward(q, k, v, k_cache, v_cache, meta), iters)
    # SDPA on the same K/V laid out densely: the check that the kernel is right, too
    ids = torch.from_numpy(table).to(dev).long()
    kd = k_cache[ids].reshape(reqs, nb * block, kv_heads, head_dim)[:, :seq].transpose(1, 2)
    vd = v_cache[ids].reshape(reqs, nb * block, kv_heads, head_dim)[:, :seq].transpose(1, 2)
    kd, vd = kd.contiguous(), vd.contiguous()
    qd = q.view(reqs, q_len, heads, head_dim).transpose(1, 2)
    rows = ctx + torch.arange(q_len, device=dev)
    mask = torch.arange(seq, device=dev)[None, :] <= rows[:, None]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)

    want = sdpa().transpose(1, 2).reshape(t, heads, head_dim)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    sdpa_s = timer(sdpa, iters)
    kv_bytes = 2 * reqs * seq * kv_heads * head_dim * k_cache.element_size()
    gbs = kv_bytes / triton_s / 1e9
    bw = f"{gbs:.0f}" if q_len == 1 else "-"
    frac = f"{gbs / peak:.0%}" if q_len == 1 and peak else "-"
    return (
        f"| {name} | {triton_s * 1e6:.0f} | {sdpa_s * 1e6:.0f} | {sdpa_s / triton_s:.2f}x | "
        f"{bw} | {frac} | {err:.1e} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hbm-peak-gbs", type=float, help="the GPU's HBM peak (default: by name)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreted")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.dry_run:
        dev, shapes, dims, iters = torch.device("cpu"), DRY_SHAPES, DRY_DIMS, 2
        dtype, name = torch.float32, "CPU (dry run: Triton interpreted, timings mean nothing)"
    elif torch.cuda.is_available():
        dev, shapes, dims, iters = (
            torch.device("cuda"),
            SHAPES,
            (HEADS, KV_HEADS, HEAD_DIM, BLOCK),
            args.iters,
        )
        name = torch.cuda.get_device_name()
    else:
        print(
            "kernel_bench: needs a CUDA GPU (the Triton kernel's fast path); nothing to "
            "measure on this machine (--dry-run checks the plumbing on CPU)."
        )
        return 0
    peak = hbm_peak(name, args.hbm_peak_gbs) or (1.0 if args.dry_run else None)
    heads, kv_heads, head_dim, block = dims
    print(
        f"{name}, {str(dtype).removeprefix('torch.')}, {heads} query heads, {kv_heads} KV "
        f"heads, head_dim {head_dim}, block {block}; HBM peak "
        f"{f'{peak:.0f} GB/s' if peak else 'unknown (--hbm-peak-gbs)'}\n"
    )
    print(
        "| shape | Triton paged µs | SDPA dense µs | SDPA / Triton | decode KV GB/s | "
        "of HBM peak | max rel. diff |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in shapes:
        print(bench_shape(shape, dims, dtype, dev, iters, peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
