"""The PyTorch paged-attention backend (the CPU path and the kernels' oracle) against a
naive token-by-token computation, and its K/V writes against the slot mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.model.attention.torch_backend import (
    MAX_GROUP_REQUESTS,
    TorchAttention,
    decode_groups,
    write_kv,
)
from tests.attention_cases import SHAPES, make_case, naive_attention, relative_error


@pytest.mark.parametrize("shape", SHAPES, ids=[f"case{i}" for i in range(len(SHAPES))])
def test_torch_backend_matches_naive_attention(shape: tuple) -> None:  # type: ignore[type-arg]
    q_lens, ctx, kv_heads, group, block_size = shape
    case = make_case(q_lens, ctx, kv_heads, group, 16, block_size, seed=len(q_lens))
    k_cache, v_cache = case.caches()
    backend = TorchAttention(kv_heads * group, kv_heads, 16)
    got = backend.forward(case.q, case.k, case.v, k_cache, v_cache, case.metadata())
    assert relative_error(got, naive_attention(case)) < 1e-5


def test_write_kv_puts_each_token_in_its_slot() -> None:
    case = make_case([3, 2], [14, 0], 2, 2, 8, 16)
    k_cache, v_cache = case.caches()
    write_kv(case.k, case.v, k_cache, v_cache, torch.from_numpy(case.slot_mapping))
    flat_k = k_cache.view(-1, 2, 8)
    flat_v = v_cache.view(-1, 2, 8)
    for t, slot in enumerate(case.slot_mapping.tolist()):
        assert torch.equal(flat_k[slot], case.k[t]) and torch.equal(flat_v[slot], case.v[t])
    untouched = set(range(flat_k.shape[0])) - set(case.slot_mapping.tolist())
    for slot in list(untouched)[:50]:
        assert torch.equal(flat_k[slot], case.k_cache.view(-1, 2, 8)[slot])


def test_the_plan_is_built_once_per_step_and_shared_by_layers() -> None:
    case = make_case([4, 1], [0, 9], 1, 3, 8, 16)
    meta = case.metadata()
    backend = TorchAttention(3, 1, 8)
    k_cache, v_cache = case.caches()
    first = backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    plan = meta.plan["torch"]
    second = backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    assert meta.plan["torch"] is plan
    assert torch.equal(first, second)


def test_many_decodes_of_mixed_lengths_are_grouped_and_still_exact() -> None:
    lengths = [3, 300, 17, 250, 40, 9, 128, 290, 64, 1, 200, 33]
    case = make_case([1] * len(lengths), lengths, 1, 3, 16, 16, seed=2)
    meta = case.metadata()
    k_cache, v_cache = case.caches()
    got = TorchAttention(3, 1, 16).forward(case.q, case.k, case.v, k_cache, v_cache, meta)
    assert len(meta.plan["torch"].decodes) > 1
    assert relative_error(got, naive_attention(case)) < 1e-5


def test_decode_groups_cover_every_request_once_and_save_padding() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 800, 40)
    groups = decode_groups(lengths, 16)
    assert sorted(np.concatenate(groups).tolist()) == list(range(40))
    assert 5 <= len(groups) <= 8 and all(len(g) <= MAX_GROUP_REQUESTS for g in groups)
    assert all(lengths[g].max() <= lengths[h].min() for g, h in zip(groups, groups[1:]))
    assert len(decode_groups(np.array([100, 101, 102]), 16)) == 1
    assert len(decode_groups(np.full(8, 300), 16)) == 1  # equal lengths: no reason to split
