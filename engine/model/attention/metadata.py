"""What attention needs to know about a step, built once per step and shared by all layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """The flattened batch as attention sees it. Requests are in scheduling order; request
    r's new tokens are rows query_start_loc[r]:query_start_loc[r+1] of q/k/v."""

    num_tokens: int  # new tokens this step, all requests together
    query_start_loc: torch.Tensor  # [R+1] int32 on the device: prefix sums of query lengths
    seq_lens: torch.Tensor  # [R] int32 on the device: tokens in the cache after this step
    block_table: torch.Tensor  # [R, max_blocks] int32 on the device, padded with block 0
    slot_mapping: torch.Tensor  # [T] int64 on the device: cache slot of every new token
    max_query_len: int  # longest query this step
    max_seq_len: int  # longest sequence this step
    query_start_loc_cpu: np.ndarray  # [R+1] host copy, for planning without a device sync
    seq_lens_cpu: np.ndarray  # [R] host copy
    block_table_cpu: np.ndarray | None = None  # [R, max_blocks] host copy (CPU path)
    plan: dict[str, Any] = field(default_factory=dict)  # a backend's per-step cache

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def build_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    slot_mapping: np.ndarray,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata from host arrays (tests and tools; the runner fills persistent buffers)."""
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    return AttentionMetadata(
        num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(block_table.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(device),
        max_query_len=int(query_lens.max(initial=0)),
        max_seq_len=int(seq_lens.max(initial=0)),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens.astype(np.int32),
        block_table_cpu=block_table.astype(np.int32),
    )
