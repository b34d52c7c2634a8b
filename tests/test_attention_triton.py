"""The Triton paged-attention kernels against the PyTorch backend.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1, about a thousand times
slower than compiled code, hence the tiny shapes), in a subprocess because the variable
must be set before triton is first imported; on a CUDA machine the same cases also run
compiled, in this process."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.attention.torch_backend import TorchAttention
from tests.attention_cases import SHAPES, Case, make_case, relative_error
from tests.model_support import needs_cuda

pytest.importorskip("triton")

from engine.model.attention.triton_backend import (  # noqa: E402
    TritonAttention,
    block_m_for,
    next_pow2,
)

IDS = [f"case{i}" for i in range(len(SHAPES))]
ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def interpreted_results() -> dict[str, dict[str, object]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.triton_interpreted"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {str(r["case"]): r for r in rows}


def run_both(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, bool]:
    heads, kv_heads, dim = case.q.shape[1], case.k.shape[1], case.q.shape[2]
    ref_k, ref_v = case.caches()
    want = TorchAttention(heads, kv_heads, dim).forward(
        case.q, case.k, case.v, ref_k, ref_v, case.metadata()
    )
    k_cache, v_cache = (c.to(device) for c in case.caches())
    got = TritonAttention(heads, kv_heads, dim).forward(
        case.q.to(device),
        case.k.to(device),
        case.v.to(device),
        k_cache,
        v_cache,
        case.metadata(device),
    )
    caches_equal = torch.equal(k_cache.cpu(), ref_k) and torch.equal(v_cache.cpu(), ref_v)
    return got.cpu(), want, caches_equal


@pytest.mark.parametrize("case", IDS)
def test_interpreted_kernel_matches_reference(case: str) -> None:
    result = interpreted_results()[case]
    assert result["caches_equal"], "the store kernel wrote different K/V slots"
    assert float(result["rel_err"]) < 1e-5  # type: ignore[arg-type]


def test_group_of_three_is_padded_to_four_and_head_dim_to_a_power_of_two() -> None:
    backend = TritonAttention(num_heads=9, num_kv_heads=3, head_dim=64)
    assert (backend.group, backend.group_pad, backend.head_dim_pad) == (3, 4, 64)
    assert next_pow2(3) == 4 and next_pow2(1) == 1 and next_pow2(17) == 32
    # tl.dot needs >= 16 rows: a decode tile of a group of 4 holds 4 tokens.
    assert block_m_for(1, 4) == 4 and block_m_for(1, 1) == 16
    assert block_m_for(300, 4) * 4 <= 64


def test_odd_head_dim_is_masked() -> None:
    result = interpreted_results()["odd_head_dim"]
    assert result["caches_equal"] and float(result["rel_err"]) < 1e-5  # type: ignore[arg-type]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_compiled_kernel_matches_reference_on_cuda(shape: tuple) -> None:  # type: ignore[type-arg]
    q_lens, ctx, kv_heads, group, block_size = shape
    case = make_case(q_lens, ctx, kv_heads, group, 64, block_size, seed=11)
    got, want, caches_equal = run_both(case, torch.device("cuda"))
    assert caches_equal
    assert relative_error(got, want) < 1e-5


@pytest.mark.cuda
@needs_cuda
def test_compiled_kernel_in_bfloat16_on_cuda() -> None:
    case = make_case([17, 1, 1], [0, 100, 7], 3, 3, 64, 16, seed=5, dtype=torch.bfloat16)
    got, want, _ = run_both(case, torch.device("cuda"))
    assert relative_error(got.float(), want.float()) < 2e-2
