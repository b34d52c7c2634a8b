"""The documented range of every numeric knob and workload field, in one table.

Each value is checked once, where its config or workload is validated, and a value outside
its range is a ValueError naming the key and the range. The ranges are wide enough for
any real run and small enough that no value in them exhausts memory or time: they exist so
that a typo (`num_blocks` 1e12) fails at once instead of after gigabytes. The trace readers
use the same numbers (recorder.schema re-exports them), so anything a run may record, every
reader accepts. docs/workload-format.md lists them."""

from __future__ import annotations

import math

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_NUM_BLOCKS = 1 << 22  # KV blocks: the block map of a reader must fit in memory
MAX_TOKENS = 1 << 24  # any token count: lengths, budgets, max_tokens
MAX_TOKEN_ID = (1 << 31) - 1  # token ids fit int32 (every vocabulary does)
MAX_ID_CHARS = 1 << 10  # request ids
MAX_LOGIT_BIAS = 1 << 16  # entries of one request's logit_bias
MAX_ARRIVAL_S = 1e7  # seconds (about four months): later arrivals are typos
MAX_TEMPLATE_CHARS = 1 << 25  # a chat template's rendered prompt, and any string it builds
MAX_TEMPLATE_S = 2.0  # a chat template's rendering time (a normal one takes milliseconds)

# name: (lowest, highest); None for "no value" is handled by the caller
RANGES: dict[str, tuple[float, float]] = {
    "block_size": (1, 4096),
    "num_blocks": (2, MAX_NUM_BLOCKS),
    "max_num_batched_tokens": (1, MAX_TOKENS),
    "max_num_seqs": (1, 1 << 16),
    "max_num_active_seqs": (1, 1 << 16),
    "max_model_len": (2, MAX_TOKENS),
    "long_prefill_token_threshold": (0, MAX_TOKENS),
    "num_speculative_tokens": (0, 64),
    "max_steps": (1, 1 << 31),
    # runner options
    "kv_cache_memory": (1, 1 << 40),  # bytes: at most 1 TiB
    "num_gpu_blocks_override": (2, MAX_NUM_BLOCKS),
    "profile_every": (0, 1 << 31),
    "num_threads": (1, 1024),
    "seed": (0, INT64_MAX),  # the runner's and a request's
    # request fields
    "max_tokens": (1, MAX_TOKENS),
    "top_k": (0, 1 << 20),  # 0: off; larger than the vocabulary means all of it
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),  # OpenAI's and vLLM's range
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 100.0),  # vLLM: > 0 (0 itself is refused by the caller)
    "min_p": (0.0, 1.0),
    "logit_bias": (-100.0, 100.0),  # OpenAI's range (vLLM clamps to it)
    "logprobs": (0, 20),  # vLLM's default --max-logprobs
    "priority": (INT64_MIN, INT64_MAX),
    "arrival_step": (0, 1 << 31),
    "arrival_time": (0.0, MAX_ARRIVAL_S),
    "token_id": (0, MAX_TOKEN_ID),
}


def check_range(name: str, value: float, key: str | None = None) -> None:
    """Raise ValueError when `value` is outside `name`'s range (or NaN); `key` is how the
    message names it (default: `name`)."""
    lo, hi = RANGES[name]
    if (isinstance(value, float) and not math.isfinite(value)) or not lo <= value <= hi:
        raise ValueError(f"{key or name}={value!r}: must be in [{fmt_bound(lo)}, {fmt_bound(hi)}]")


def fmt_bound(v: float) -> str:
    """A range's end as messages and the docs write it: 2^22, 2^63-1, 4096."""
    if isinstance(v, int) and abs(v) >= 1 << 16 and v & (v - 1) == 0:
        return f"2^{v.bit_length() - 1}"
    if isinstance(v, int) and v in (INT64_MAX, INT64_MIN):
        return "-2^63" if v < 0 else "2^63-1"
    if isinstance(v, int) and v + 1 & v == 0 and v > 1 << 16:
        return f"2^{v.bit_length()}-1"
    return str(v)
