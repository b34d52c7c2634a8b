"""The C paged-attention kernel (the CPU backend) against the naive oracle, its fallbacks,
and the promise it exists for: a decode step reads the paged cache in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, RunnerOptions
from engine.model.attention import cpu_backend, native
from engine.model.attention.cpu_backend import CpuPagedAttention
from engine.model.attention.torch_backend import TorchAttention
from engine.model.errors import ModelError
from engine.model.runner import build_runner
from tests.attention_cases import SHAPES, make_case, naive_attention, relative_error
from tests.model_support import tiny_model

pytestmark = pytest.mark.skipif(
    native.kernel() is None, reason=f"no C kernel here: {native.kernel_status()}"
)


def run(case_args: tuple, head_dim: int = 16, seed: int = 0) -> float:  # type: ignore[type-arg]
    q_lens, ctx, kv_heads, group, block_size = case_args
    case = make_case(q_lens, ctx, kv_heads, group, head_dim, block_size, seed=seed)
    k_cache, v_cache = case.caches()
    backend = CpuPagedAttention(kv_heads * group, kv_heads, head_dim)
    got = backend.forward(case.q, case.k, case.v, k_cache, v_cache, case.metadata())
    return relative_error(got, naive_attention(case))


@pytest.mark.parametrize("shape", SHAPES, ids=[f"case{i}" for i in range(len(SHAPES))])
@pytest.mark.parametrize(
    "limit", [0, cpu_backend.KERNEL_MAX_QUERY, 1 << 20], ids=["sdpa-chunks", "default", "all-rows"]
)
def test_kernel_matches_naive_attention(
    shape: tuple,  # type: ignore[type-arg]
    limit: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_QUERY", limit)
    assert run(shape, seed=len(shape[0])) < 1e-5


# unrolled (group, head size) pairs, and run-time ones (a group of 5, a head of 40)
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128), (1, 64), (5, 64), (3, 40)])
def test_every_head_shape_path_is_exact(group: int, head_dim: int) -> None:
    shape = ([1, 3, 1], [70, 20, 5], 2, group, 16)
    assert run(shape, head_dim=head_dim, seed=head_dim + group) < 1e-5


def test_many_decodes_on_two_threads_are_exact() -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lengths = [3, 300, 17, 250, 40, 9, 128, 290, 64, 1, 200, 33, 511, 5, 77, 160]
        assert run(([1] * len(lengths), lengths, 3, 3, 16), head_dim=64, seed=3) < 1e-5
    finally:
        torch.set_num_threads(saved)


def test_a_decode_step_reads_the_cache_in_place() -> None:
    """The PyTorch backend copies every request's K/V out of the cache (index_select);
    the kernel must not: its only cache traffic is writing the new tokens."""
    case = make_case([1] * 8, [40, 100, 7, 64, 250, 16, 33, 90], 3, 3, 64, 16, seed=5)
    ops = {}
    for backend in (TorchAttention(9, 3, 64), CpuPagedAttention(9, 3, 64)):
        k_cache, v_cache = case.caches()
        meta = case.metadata()
        with torch.profiler.profile() as prof:
            backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta)
        ops[backend.name] = {e.key for e in prof.key_averages()}
    assert "aten::index_select" in ops["torch"]
    assert not {"aten::index_select", "aten::gather", "aten::index"} & ops["cpu"]


def test_what_the_kernel_does_not_cover_goes_to_the_torch_backend() -> None:
    case = make_case([5, 1], [0, 40], 1, 3, 16, 16, dtype=torch.bfloat16)
    meta = case.metadata()
    k_cache, v_cache = case.caches()
    got = CpuPagedAttention(3, 1, 16).forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    assert "cpu" not in meta.plan and "torch" in meta.plan
    assert relative_error(got, naive_attention(case)) < 2e-2


def test_the_runner_picks_the_kernel_on_cpu_and_refuses_it_where_it_cannot_run() -> None:
    model = tiny_model()
    config = EngineConfig(max_model_len=256)
    runner, _ = build_runner(model, config, RunnerOptions(device="cpu"))
    assert runner.model.attention.name == "cpu"
    runner, _ = build_runner(model, config, RunnerOptions(device="cpu", dtype="bfloat16"))
    assert runner.model.attention.name == "torch"  # auto: the fallback, quietly
    with pytest.raises(ModelError, match="attention_backend=cpu: it computes in float32"):
        build_runner(
            model, config, RunnerOptions(device="cpu", dtype="bfloat16", attention_backend="cpu")
        )


def test_the_build_is_cached_by_content(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_no_compiler_is_a_clear_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(native.KernelUnavailable, match="no C compiler"):
        native.build(tmp_path)


def test_a_failing_compiler_is_a_clear_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\necho 'fakecc: broken toolchain' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    out = tmp_path / "cache"
    with pytest.raises(native.KernelUnavailable, match="broken toolchain"):
        native.build(out)
    assert not any(out.iterdir())  # the temporary output is removed


def test_rows_of_a_mixed_step_cover_every_short_request_token() -> None:
    case = make_case([1, 5, 40, 1], [10, 3, 0, 31], 1, 3, 16, 16)
    meta = case.metadata()
    k_cache, v_cache = case.caches()
    CpuPagedAttention(3, 1, 16).forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    plan = meta.plan["cpu"]
    # decode 0, the 5-token chunk (rows 1..5), decode 3 (row 46); the 40-token one to SDPA
    assert sorted(plan.rows.tolist()) == [0, 1, 2, 3, 4, 5, 46]
    lens = dict(zip(plan.rows.tolist(), plan.row_len.tolist()))
    assert lens == {0: 11, 1: 4, 2: 5, 3: 6, 4: 7, 5: 8, 46: 32}
    assert list(plan.row_len) == sorted(plan.row_len, reverse=True)
    assert [(p.start, p.end) for p in plan.prefills] == [(6, 46)]
    assert np.all(plan.table == case.block_table.astype(np.int32))


# Verification-shaped steps: decodes beside requests with 2..5 query tokens (a token and
# its drafts), contexts that put the query across a block boundary (15 + 5 over 16) or
# exactly on one (16), no context at all, and a long context.
VERIFY_STEPS = [
    ([1, 5, 3, 2, 5, 1], [40, 15, 14, 16, 0, 7]),
    ([5, 5, 5, 5], [11, 12, 13, 300]),
    ([2, 1, 4], [31, 1, 29]),
]


@pytest.mark.parametrize("q_lens,ctx", VERIFY_STEPS, ids=["ragged", "boundaries", "short"])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (4, 128), (1, 64), (5, 40)])
def test_verifying_queries_match_the_reference_in_one_kernel_call(
    q_lens: list[int], ctx: list[int], group: int, head_dim: int
) -> None:
    """Multi-token queries (causal within the query) go through the kernel with the
    decodes, in one call, and match both the naive oracle and the PyTorch backend."""
    kv_heads = 2
    case = make_case(q_lens, ctx, kv_heads, group, head_dim, 16, seed=sum(ctx) + group)
    meta = case.metadata()
    k_cache, v_cache = case.caches()
    backend = CpuPagedAttention(kv_heads * group, kv_heads, head_dim)
    got = backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    plan = meta.plan["cpu"]
    assert not plan.prefills and len(plan.rows) == sum(q_lens)
    assert relative_error(got, naive_attention(case)) < 1e-5
    k2, v2 = case.caches()
    ref = TorchAttention(kv_heads * group, kv_heads, head_dim).forward(
        case.q, case.k, case.v, k2, v2, case.metadata()
    )
    assert relative_error(got, ref) < 1e-5
