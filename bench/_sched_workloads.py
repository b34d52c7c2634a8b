"""Workloads for the scheduler benchmark, shared by our side and the vLLM peer.

Both sides build the same requests and drive `schedule()` + `update_from_output()` with a
scripted runner whose cost is left out of the timing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

# What both sides time a step with. "cpu": the stepping thread's CPU time, which other
# processes on a shared machine barely move (the default: the figure is CPU per step);
# "wall": elapsed time, which they do.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


@dataclass(frozen=True)
class Case:
    name: str  # table row label
    num_decodes: int  # requests decoding in steady state
    prefill_len: int  # 0, or the length of prompts that arrive every step (chunked prefill)
    budget: int  # max_num_batched_tokens
    threshold: int  # long_prefill_token_threshold
    steps: int  # timed steps per run
    block_size: int = 16

    @property
    def max_num_seqs(self) -> int:
        return self.num_decodes + (64 if self.prefill_len else 0)

    @property
    def num_blocks(self) -> int:
        per_req = (8 + 64 + self.steps * 2 + self.prefill_len) // self.block_size + 2
        return self.max_num_seqs * per_req + 16

    def prompt(self, i: int, length: int) -> list[int]:
        return [(i * 7919 + j) % 30000 + 10 for j in range(length)]


CASES = [
    Case("decode 64", 64, 0, 8192, 0, 400),
    Case("decode 256", 256, 0, 8192, 0, 200),
    Case("decode 1024", 1024, 0, 8192, 0, 100),
    Case("decode 4096", 4096, 0, 8192, 0, 40),
    Case("mixed 256 + 2k prompts", 256, 2000, 2048, 512, 100),
]
