"""Runs the Triton kernels under Triton's CPU interpreter and prints one JSON line per
case. A separate process, because TRITON_INTERPRET must be set before triton is first
imported (test_attention_triton.py runs it)."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from engine.model.attention.torch_backend import TorchAttention  # noqa: E402
from engine.model.attention.triton_backend import TritonAttention  # noqa: E402
from tests.attention_cases import SHAPES, make_case, relative_error  # noqa: E402

EXTRA = {"odd_head_dim": ([3, 1], [5, 20], 1, 3, 16, 12)}


def run(
    q_lens: list[int], ctx: list[int], kv_heads: int, group: int, block_size: int, head_dim: int
) -> dict[str, object]:
    case = make_case(q_lens, ctx, kv_heads, group, head_dim, block_size, seed=7)
    heads = kv_heads * group
    ref_k, ref_v = case.caches()
    want = TorchAttention(heads, kv_heads, head_dim).forward(
        case.q, case.k, case.v, ref_k, ref_v, case.metadata()
    )
    k_cache, v_cache = case.caches()
    got = TritonAttention(heads, kv_heads, head_dim).forward(
        case.q, case.k, case.v, k_cache, v_cache, case.metadata()
    )
    return {
        "rel_err": relative_error(got, want),
        "caches_equal": torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v),
    }


def main() -> None:
    for i, (q_lens, ctx, kv_heads, group, block_size) in enumerate(SHAPES):
        print(
            json.dumps({"case": f"case{i}", **run(q_lens, ctx, kv_heads, group, block_size, 16)}),
            flush=True,
        )
    for name, (q_lens, ctx, kv_heads, group, block_size, dim) in EXTRA.items():
        print(
            json.dumps({"case": name, **run(q_lens, ctx, kv_heads, group, block_size, dim)}),
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
