"""The model's matrix products on packed oneDNN weights: the same numbers as F.linear for
every row count the engine uses, chosen only where they apply, and off on request."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.cpu_linear import DenseLinear, PackedLinear, choose_linear, packed_status
from tests.model_support import tiny_model

needs_packed = pytest.mark.skipif(packed_status() != "ok", reason=packed_status())


@needs_packed
@pytest.mark.parametrize("rows", [1, 4, 5, 20, 33, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    x = torch.randn(rows, 96, generator=gen)
    lin = PackedLinear()
    with torch.inference_mode():
        got = lin(x, lin.pack(weight), b)
    want = F.linear(x, weight, b)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)


@needs_packed
def test_the_model_packs_on_the_cpu_in_fp32_only() -> None:
    assert choose_linear(torch.device("cpu"), torch.float32).name == "onednn"
    assert choose_linear(torch.device("cpu"), torch.bfloat16).name == "torch"
    assert choose_linear(torch.device("cuda"), torch.float32).name == "torch"


@needs_packed
def test_a_packed_model_computes_what_a_dense_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.model.attention.torch_backend import TorchAttention
    from engine.model.llama import LlamaModel

    loaded = tiny_model()
    spec = loaded.spec
    attention = TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    cpu = torch.device("cpu")
    packed = LlamaModel(spec, loaded.weights, attention, cpu, torch.float32)
    monkeypatch.setattr("engine.model.llama.choose_linear", lambda *_: DenseLinear())
    dense = LlamaModel(spec, loaded.weights, attention, cpu, torch.float32)
    assert packed.linear.name == "onednn" and dense.linear.name == "torch"
    hidden = torch.randn(7, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = packed.compute_logits(hidden), dense.compute_logits(hidden)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


def test_the_environment_turns_packing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    packed_status.cache_clear()
    monkeypatch.setenv("SCHEDTOP_NO_ONEDNN", "1")
    try:
        assert packed_status() == "disabled by SCHEDTOP_NO_ONEDNN"
        assert choose_linear(torch.device("cpu"), torch.float32).name == "torch"
    finally:
        monkeypatch.delenv("SCHEDTOP_NO_ONEDNN")
        packed_status.cache_clear()


def test_a_broken_build_falls_back_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: PackedLinear, weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no oneDNN kernel for this CPU")

    packed_status.cache_clear()
    monkeypatch.setattr(PackedLinear, "pack", broken)
    try:
        assert "no oneDNN kernel for this CPU" in packed_status()
        assert choose_linear(torch.device("cpu"), torch.float32).name == "torch"
    finally:
        monkeypatch.undo()
        packed_status.cache_clear()
