"""Matrix products with the weights on the CPU: oneDNN with weights packed once at load
time, where PyTorch has it, else torch's own F.linear.

On the project's AMD CPU, F.linear (MKL's sgemm) runs the model's fp32 products at about
half of what oneDNN does with its weights reordered once into its blocked layout
(bench/spec_bench.py's step breakdown and bench/linear_bench.py: 2 to 2.7x on one thread,
for 1 to 512 rows). The reorder happens when the model loads; each step then calls
oneDNN's linear on the packed weight. The packed tensor is opaque (torch's mkldnn layout):
only `linear` below may use it.

oneDNN and MKL add in different orders, so logits differ in the last bits; greedy parity
with transformers (tests/test_model_hf_parity.py) holds either way.
SCHEDTOP_NO_ONEDNN=1 turns the packing off (F.linear everywhere)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

# The row count oneDNN's reorder is told to expect: the layout it picks at 32 rows is
# within a few percent of the best from 4-row decodes to 512-row prefill chunks.
PACK_ROWS_HINT = 32


class DenseLinear:
    """F.linear on the weights as they are: every device, every dtype."""

    name = "torch"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)


class PackedLinear:
    """oneDNN's linear on weights reordered once into its layout (CPU, fp32)."""

    name = "onednn"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.contiguous(), PACK_ROWS_HINT
        )
        return packed

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out


Linear = DenseLinear | PackedLinear


def choose_linear(device: torch.device, dtype: torch.dtype) -> Linear:
    """PackedLinear where it runs and agrees with F.linear, else DenseLinear."""
    if device.type != "cpu" or dtype != torch.float32 or packed_status() != "ok":
        return DenseLinear()
    return PackedLinear()


@functools.cache
def packed_status() -> str:
    """'ok', or why the packed oneDNN path is not used in this process."""
    if os.environ.get("SCHEDTOP_NO_ONEDNN"):
        return "disabled by SCHEDTOP_NO_ONEDNN"
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch build has no oneDNN (mkldnn)"
    try:  # a build whose ops are missing or broken falls back instead of failing a step
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=gen)
        bias = torch.randn(48, generator=gen)
        x = torch.randn(5, 40, generator=gen)
        with torch.inference_mode():
            got = PackedLinear()(x, PackedLinear().pack(weight), bias)
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"oneDNN's packed linear failed: {str(e).splitlines()[0] if str(e) else e!r}"
    want = F.linear(x, weight, bias)
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
        return "oneDNN's packed linear disagrees with F.linear"
    return "ok"
