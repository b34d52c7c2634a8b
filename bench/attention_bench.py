"""CPU paged attention: the candidates side by side, and a whole decode step of the model
over the paged cache against the same batch over a contiguous cache.

1. Attention alone (one layer of the default model's shape: 9 query heads, 3 KV heads,
   head_dim 64, blocks of 16), a batch of decodes whose lengths are drawn like the
   engine bench's requests, every candidate timed alternately in one process:
   - torch: the PyTorch backend (gathers each request's K/V rows into a dense copy, then
     SDPA in groups of at most 8 requests);
   - blocks: gathers whole blocks (contiguous runs of block_size x KV heads x D), then
     SDPA on the strided view, one group;
   - compiled: the torch backend's gather + SDPA under torch.compile (--compile; its first
     call compiles for minutes on two cores);
   - cpu: the C kernel (engine/model/attention/csrc), which reads the blocks in place;
   - contiguous: SDPA over a dense [B, KV heads, L, D] cache with no paging, one batch
     padded to the longest request, or grouped by length like the torch backend; the
     faster of the two is the reference.
2. The model's decode step (the default model, fp32): 32 requests over the paged cache
   with the torch and cpu backends, against the same requests over a preallocated
   contiguous cache (as a static-batch engine keeps it), medians of alternated runs.
3. --crossover: chunks of n tokens after 512 tokens of context, the kernel (one row per
   token) against SDPA, to place KERNEL_MAX_QUERY.

    .venv/bin/python bench/attention_bench.py [--requests 32] [--iters 30] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.attention import cpu_backend, native  # noqa: E402
from engine.model.attention.cpu_backend import CpuPagedAttention  # noqa: E402
from engine.model.attention.metadata import AttentionMetadata, build_metadata  # noqa: E402
from engine.model.attention.torch_backend import (  # noqa: E402
    TorchAttention,
    decode_groups,
    write_kv,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def lengths_like_engine_bench(n: int, seed: int) -> np.ndarray:
    """Prompt 32-512 plus a point in a 16-256 token output: the engine bench's decodes."""
    rng = np.random.default_rng(seed)
    return rng.integers(32, 513, n) + rng.integers(1, 257, n)


class PagedBatch:
    """Decodes over a shuffled paged cache, with the metadata for one step."""

    def __init__(self, lens: np.ndarray, seed: int, num_layers: int = 1) -> None:
        rng = np.random.default_rng(seed)
        nbs = -(-lens // BLOCK)
        self.num_blocks = int(nbs.sum()) + 1
        order = 1 + rng.permutation(self.num_blocks - 1)
        table = np.zeros((len(lens), int(nbs.max())), dtype=np.int64)
        at = 0
        for i, nb in enumerate(nbs):
            table[i, :nb] = order[at : at + nb]
            at += nb
        pos = lens - 1
        slots = table[np.arange(len(lens)), pos // BLOCK] * BLOCK + pos % BLOCK
        self.lens, self.table, self.slots = lens, table, slots
        shape = (self.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        self.layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(num_layers)]

    def meta(self) -> AttentionMetadata:
        ones = np.ones(len(self.lens), dtype=np.int64)
        return build_metadata(ones, self.lens, self.table, self.slots, torch.device("cpu"))


class ContiguousAttention:
    """Attention over dense, preallocated [B, KV heads, L, D] caches per layer, as a
    static-batch engine keeps them: the new K/V go in at each request's position, then
    SDPA with a padding mask. One batch padded to the longest request, or (grouped) the
    requests split by length as the torch backend splits them, each group dense and
    padded only to its own longest. The paged caches it is handed only key the layers."""

    def __init__(self, lens: np.ndarray, grouped: bool = False) -> None:
        self.name = "contiguous, grouped" if grouped else "contiguous"
        parts = decode_groups(lens, BLOCK) if grouped else [np.arange(len(lens))]
        self.groups = []
        for idx in parts:
            g_lens = torch.from_numpy(lens[idx])
            width = int(g_lens.max())
            mask = torch.where(torch.arange(width)[None, :] < g_lens[:, None], 0.0, -torch.inf)
            self.groups.append((torch.from_numpy(idx), g_lens - 1, mask[:, None, None, :]))
        self.caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        dense = self.caches.get(k_cache.data_ptr())
        if dense is None:
            dense = self.caches[k_cache.data_ptr()] = [
                (torch.randn(shape), torch.randn(shape))
                for shape in (
                    (len(idx), KV_HEADS, mask.shape[-1], HEAD_DIM) for idx, _, mask in self.groups
                )
            ]
        out = torch.empty_like(q)
        for (idx, last, mask), (kd, vd) in zip(self.groups, dense):
            at = torch.arange(len(idx))
            kd[at, :, last] = k[idx]
            vd[at, :, last] = v[idx]
            query = q[idx].view(len(idx), KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
            attn = F.scaled_dot_product_attention(query, kd, vd, attn_mask=mask)
            out[idx] = attn.reshape(len(idx), HEADS, HEAD_DIM)
        return out


class BlockGatherAttention:
    """Gathers whole blocks per request (one index_select of contiguous block rows) and
    runs SDPA on the [B, KV heads, L, D] strided view: one group, padded to the longest."""

    name = "blocks"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.plan.get("blocks")
        if plan is None:
            lens = torch.from_numpy(meta.seq_lens_cpu.astype(np.int64))
            ids = meta.block_table.long().reshape(-1)
            width = meta.block_table.shape[1] * BLOCK
            mask = torch.where(torch.arange(width)[None, :] < lens[:, None], 0.0, -torch.inf)
            plan = meta.plan["blocks"] = (ids, mask[:, None, None, :])
        ids, mask = plan
        b = q.shape[0]

        def gather(cache: torch.Tensor) -> torch.Tensor:
            flat = cache.view(cache.shape[0], -1).index_select(0, ids)
            return flat.view(b, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)

        query = q.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        out = F.scaled_dot_product_attention(query, gather(k_cache), gather(v_cache), mask)
        return out.reshape(b, HEADS, HEAD_DIM)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Median seconds per call, the candidates interleaved so that load hits all alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters):
        names = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in names:
            times[name].append(timed(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def attention_candidates(n: int, iters: int, seed: int, compile_too: bool) -> None:
    lens = lengths_like_engine_bench(n, seed)
    batch = PagedBatch(lens, seed)
    kc, vc = batch.layers[0]
    q = torch.randn(n, HEADS, HEAD_DIM)
    k = torch.randn(n, KV_HEADS, HEAD_DIM)
    v = torch.randn(n, KV_HEADS, HEAD_DIM)
    backends: dict[str, Any] = {
        "torch": TorchAttention(HEADS, KV_HEADS, HEAD_DIM),
        "blocks": BlockGatherAttention(),
        "cpu": CpuPagedAttention(HEADS, KV_HEADS, HEAD_DIM),
        "contiguous": ContiguousAttention(lens),
        "contiguous, grouped": ContiguousAttention(lens, grouped=True),
    }
    if compile_too:
        compiled = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
        compiled._decode = torch.compile(compiled._decode, dynamic=False)  # type: ignore[method-assign]
        backends["compiled"] = compiled
    metas = {name: batch.meta() for name in backends}  # each its own plan, built once
    want = backends["torch"].forward(q, k, v, kc, vc, metas["torch"])
    got = backends["cpu"].forward(q, k, v, kc, vc, metas["cpu"])
    err = float((got - want).abs().max() / want.abs().max())
    fns = {
        name: (lambda b=b, m=metas[name]: b.forward(q, k, v, kc, vc, m))
        for name, b in backends.items()
    }
    with torch.inference_mode():
        res = alternate(fns, iters)
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 4
    print(
        f"\n1. attention alone, one layer: {n} decodes of {lens.min()}-{lens.max()} tokens "
        f"(mean {lens.mean():.0f}), {torch.get_num_threads()} threads, "
        f"K/V read {kv_bytes / 2**20:.1f} MiB; cpu vs torch max rel. error {err:.1e}\n"
    )
    print("| candidate | µs per layer | / best contiguous | K/V GB/s |")
    print("| --- | ---: | ---: | ---: |")
    base = min(res["contiguous"], res["contiguous, grouped"])
    for name, s in sorted(res.items(), key=lambda x: x[1]):
        print(f"| {name} | {s * 1e6:.0f} | {s / base:.2f}x | {kv_bytes / s / 1e9:.1f} |")


def decode_step(n: int, iters: int, seed: int) -> None:
    from engine.model.llama import LlamaModel
    from engine.model.loader import load_model

    loaded = load_model()
    spec = loaded.spec
    lens = lengths_like_engine_bench(n, seed)
    batch = PagedBatch(lens, seed, spec.num_layers)
    cpu = torch.device("cpu")
    backends: dict[str, Any] = {
        "paged torch (before)": TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim),
        "paged cpu kernel": CpuPagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim),
        "contiguous": ContiguousAttention(lens),
        "contiguous, grouped": ContiguousAttention(lens, grouped=True),
    }
    models = {
        name: LlamaModel(spec, loaded.weights, b, cpu, torch.float32)
        for name, b in backends.items()
    }
    ids = torch.randint(17, spec.vocab_size, (n,))
    positions = torch.from_numpy(lens - 1)

    def step(name: str) -> Callable[[], Any]:
        return lambda: models[name].forward(ids, positions, batch.meta(), batch.layers)

    with torch.inference_mode():
        res = alternate({name: step(name) for name in models}, iters)
    base = min(res["contiguous"], res["contiguous, grouped"])
    print(
        f"\n2. decode step of the default model ({spec.num_layers} layers, fp32): {n} requests "
        f"of {lens.min()}-{lens.max()} tokens (mean {lens.mean():.0f}), "
        f"{torch.get_num_threads()} threads, median of {iters} alternated steps\n"
    )
    print("| forward | ms per step | / best contiguous |")
    print("| --- | ---: | ---: |")
    for name, s in res.items():
        print(f"| {name} | {s * 1e3:.1f} | {s / base:.3f}x |")


def time_chunk(cpu: CpuPagedAttention, n: int, ctx: int, iters: int, seed: int) -> dict[str, float]:
    """One request's chunk of n tokens after ctx cached ones: kernel rows, then SDPA."""
    batch = PagedBatch(np.array([ctx + n]), seed)
    kc, vc = batch.layers[0]
    pos = np.arange(ctx, ctx + n)
    slots = batch.table[0, pos // BLOCK] * BLOCK + pos % BLOCK
    q = torch.randn(n, HEADS, HEAD_DIM)
    k = torch.randn(n, KV_HEADS, HEAD_DIM)
    v = torch.randn(n, KV_HEADS, HEAD_DIM)
    res = {}
    saved = cpu_backend.KERNEL_MAX_QUERY
    try:
        for label, limit in (("kernel", 1 << 30), ("sdpa", 0)):
            cpu_backend.KERNEL_MAX_QUERY = limit
            meta = build_metadata(np.array([n]), batch.lens, batch.table, slots, kc.device)
            cpu.forward(q, k, v, kc, vc, meta)  # the plan, under this limit
            with torch.inference_mode():
                fn = {label: lambda m=meta: cpu.forward(q, k, v, kc, vc, m)}
                res[label] = alternate(fn, iters)[label]
    finally:
        cpu_backend.KERNEL_MAX_QUERY = saved
    return res


def crossover(iters: int, seed: int) -> None:
    cpu = CpuPagedAttention(HEADS, KV_HEADS, HEAD_DIM)
    print("\n3. one chunk after 512 tokens of context: kernel rows vs SDPA\n")
    print("| chunk tokens | kernel µs | SDPA µs | kernel / SDPA |")
    print("| ---: | ---: | ---: | ---: |")
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        res = time_chunk(cpu, n, 512, iters, seed)
        print(
            f"| {n} | {res['kernel'] * 1e6:.0f} | {res['sdpa'] * 1e6:.0f} | "
            f"{res['kernel'] / res['sdpa']:.2f}x |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile the gather path")
    ap.add_argument("--crossover", action="store_true", help="also place KERNEL_MAX_QUERY")
    ap.add_argument("--no-model", action="store_true", help="skip the model's decode step")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.kernel() is None:
        print(f"the C kernel is not available here: {native.kernel_status()}")
        return 1
    attention_candidates(args.requests, args.iters, args.seed, args.compile)
    if args.crossover:
        crossover(args.iters, args.seed)
    if not args.no_model:
        decode_step(args.requests, max(5, args.iters // 3), args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
