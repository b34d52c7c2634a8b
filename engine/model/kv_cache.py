"""KV cache tensors and their sizing: one K and one V tensor per layer, each
[num_blocks, block_size, num_kv_heads, head_dim], all views of a single allocation."""

from __future__ import annotations

import torch

from engine.model.errors import ModelError
from engine.model.spec import ModelSpec

DEFAULT_CPU_KV_MEMORY = 2**30  # 1 GiB: about 23k tokens of SmolLM2-135M in fp32


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def blocks_for_memory(memory: int, spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks fit in `memory` bytes; fewer than two is a ModelError."""
    per_block = bytes_per_block(spec, block_size, dtype)
    n = memory // per_block
    if n < 2:
        raise ModelError(
            f"a KV cache of {memory} bytes holds {n} blocks of {per_block} "
            "bytes; it needs at least 2 (block 0 is the null block)"
        )
    return int(n)


def cuda_kv_memory(device: torch.device, utilization: float, activation_peak: int) -> int:
    """Bytes left for KV on a GPU: `utilization` of its memory, minus what is in use now
    (the weights) and the peak a forward pass needs on top of that."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    budget = int(total * utilization) - used - activation_peak
    if budget <= 0:
        raise ModelError(
            f"--gpu-memory-utilization={utilization}: {used / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB is already in use; no room for a KV cache"
        )
    return budget


class KVCache:
    """The paged KV pool. Block 0 is the null block: block tables are padded with it and
    it stays zero, so padded reads are finite and masked away."""

    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(
            spec.num_layers,
            2,
            num_blocks,
            block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=dtype,
            device=device,
        )
        self.layers = [(self.storage[i, 0], self.storage[i, 1]) for i in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
