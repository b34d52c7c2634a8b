"""The one engine configuration: frozen, validated once, knob names as vLLM spells them.

Lower layers (Scheduler, KVCacheManager) take plain values from it; only this module
knows about validation, so a bad value is reported once, with the field's name.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.limits import RANGES, check_range

POLICIES = ("fcfs", "priority")
SPEC_METHODS = ("ngram",)
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: how drafts are proposed. Only prompt lookup (n-gram)
    is supported: it needs no draft model."""

    method: str = "ngram"  # the proposer; "ngram": prompt lookup over the request's tokens
    num_speculative_tokens: int = 1  # drafts proposed per step and request, at most
    prompt_lookup_max: int = 5  # longest suffix n-gram looked up
    prompt_lookup_min: int = 5  # shortest suffix n-gram that may match

    def __post_init__(self) -> None:
        name = "speculative_config"
        _require(self.method in SPEC_METHODS, f"{name}.method", self.method, "must be 'ngram'")
        for key in _SPEC_KEYS[1:]:
            value = getattr(self, key)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            _require(ok, f"{name}.{key}", value, "must be an integer >= 1")
        _require(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            f"{name}.prompt_lookup_min",
            self.prompt_lookup_min,
            f"must be <= prompt_lookup_max ({self.prompt_lookup_max})",
        )

    @classmethod
    def from_dict(cls, values: object) -> SpeculativeConfig:
        """Parse vLLM's JSON object; a missing lookup bound takes the other's value (both
        missing: 5), as vLLM does."""
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config={values!r}: expected a JSON object")
        unknown = sorted(set(values) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key {unknown[0]!r}; known keys: "
                + ", ".join(_SPEC_KEYS)
            )
        if "method" not in values or "num_speculative_tokens" not in values:
            raise ValueError(
                "speculative_config: needs 'method' and 'num_speculative_tokens', e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        return cls(
            values["method"],
            values["num_speculative_tokens"],
            5 if hi is None else hi,
            5 if lo is None else lo,
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config {text!r}: not JSON ({e.msg})") from None
        return cls.from_dict(values)


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler and KV-cache knobs. Every field is settable with `--set KEY=VALUE`."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # KV blocks in the pool, including the null block 0
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_num_seqs: int = 256  # cap on running requests
    max_num_active_seqs: int | None = None  # cap on admission into running (None: max_num_seqs)
    max_model_len: int = 8192  # prompt + output tokens, at most
    long_prefill_token_threshold: int = 0  # per-request tokens per step; 0 = off
    long_prefill_token_threshold_adaptive: bool = False  # floor the cap at budget / requests
    policy: str = "fcfs"  # "fcfs" or "priority" (lower value runs first)
    enable_prefix_caching: bool = True  # reuse full KV blocks by content hash
    enable_chunked_prefill: bool = True  # False: a prompt that does not fit the budget waits
    watermark: float = 0.0  # fraction of blocks kept free when admitting beside running requests
    scheduler_reserve_full_isl: bool = True  # admit only if the whole sequence fits in KV
    num_speculative_tokens: int = 0  # draft tokens proposed per decode step (0 = off)
    speculative_config: SpeculativeConfig | None = None  # the drafter (None: simulated, in sim)
    async_scheduling: bool = False  # schedule step N+1 before step N's samples are back

    def __post_init__(self) -> None:
        self._spec_config()
        self._check_types()
        for name in _FIELD_TYPES:
            value = getattr(self, name)
            if name in RANGES and value is not None:
                check_range(name, value)
        _require(self.block_size > 0, "block_size", self.block_size, "must be > 0")
        _require(
            self.num_blocks >= 2,
            "num_blocks",
            self.num_blocks,
            "must be >= 2 (block 0 is the null block)",
        )
        _require(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "must be > 0")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= max_num_seqs ({self.max_num_seqs})",
        )
        if self.max_num_active_seqs is not None:
            _require(
                0 < self.max_num_active_seqs <= self.max_num_seqs,
                "max_num_active_seqs",
                self.max_num_active_seqs,
                f"must be in [1, max_num_seqs={self.max_num_seqs}]",
            )
        _require(self.max_model_len > 1, "max_model_len", self.max_model_len, "must be > 1")
        _require(
            0 <= self.long_prefill_token_threshold <= self.max_model_len,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            f"must be in [0, max_model_len={self.max_model_len}]",
        )
        _require(self.policy in POLICIES, "policy", self.policy, f"must be one of {POLICIES}")
        _require(0.0 <= self.watermark < 1.0, "watermark", self.watermark, "must be in [0, 1)")
        _require(
            self.num_speculative_tokens >= 0,
            "num_speculative_tokens",
            self.num_speculative_tokens,
            "must be >= 0",
        )
        if self.async_scheduling:
            _require(
                self.num_speculative_tokens == 0,
                "num_speculative_tokens",
                self.num_speculative_tokens,
                "must be 0 with async_scheduling (not supported together yet)",
            )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len ({self.max_model_len}) "
                "when enable_chunked_prefill is off",
            )

    def _spec_config(self) -> None:
        """Accept the JSON object (a workload) or its text (a trace header); the drafter's k is the
        scheduler's lookahead, so the two spellings must agree."""
        spec = self.speculative_config
        if spec is None:
            return
        if isinstance(spec, str):  # a trace header keeps it as JSON text
            spec = SpeculativeConfig.from_json(spec)
        elif not isinstance(spec, SpeculativeConfig):
            spec = SpeculativeConfig.from_dict(spec)
        object.__setattr__(self, "speculative_config", spec)
        k = spec.num_speculative_tokens
        if self.num_speculative_tokens == 0:
            object.__setattr__(self, "num_speculative_tokens", k)
        _require(
            self.num_speculative_tokens == k,
            "num_speculative_tokens",
            self.num_speculative_tokens,
            f"must equal speculative_config.num_speculative_tokens ({k})",
        )

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = _FIELD_TYPES[f.name]
            if value is None and f.name in _OPTIONAL or want is SpeculativeConfig:
                continue
            ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
                ok = True
            if not ok:
                raise ValueError(f"{f.name}={value!r}: expected {want.__name__}")

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold tokens (the null block never does)."""
        return self.num_blocks - 1

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with `changes` applied; unknown keys are a ValueError."""
        unknown = sorted(set(changes) - set(_FIELD_TYPES))
        if unknown:
            raise ValueError(
                f"unknown config key {unknown[0]!r}; known keys: " + ", ".join(sorted(_FIELD_TYPES))
            )
        if "speculative_config" in changes and "num_speculative_tokens" not in changes:
            changes["num_speculative_tokens"] = 0  # derived from the new drafter again
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict[str, Any], ignore: tuple[str, ...] = ()) -> EngineConfig:
        """Build from a workload's `config` object; keys in `ignore` are skipped."""
        return cls().replace(**{k: v for k, v in values.items() if k not in ignore})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _require(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {why}")


_OPTIONAL = {"max_num_active_seqs", "speculative_config"}
_FIELD_TYPES: dict[str, type] = {
    "block_size": int,
    "num_blocks": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "max_num_active_seqs": int,
    "max_model_len": int,
    "long_prefill_token_threshold": int,
    "long_prefill_token_threshold_adaptive": bool,
    "policy": str,
    "enable_prefix_caching": bool,
    "enable_chunked_prefill": bool,
    "watermark": float,
    "scheduler_reserve_full_isl": bool,
    "num_speculative_tokens": int,
    "speculative_config": SpeculativeConfig,
    "async_scheduling": bool,
}


def parse_setting(text: str) -> tuple[str, Any]:
    """Parse one `KEY=VALUE` from the command line into a typed pair."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE")
    if key not in _FIELD_TYPES:
        raise ValueError(
            f"unknown config key {key!r}; known keys: " + ", ".join(sorted(_FIELD_TYPES))
        )
    want = _FIELD_TYPES[key]
    raw = raw.strip()
    if want is SpeculativeConfig:
        return key, SpeculativeConfig.from_json(raw)  # its errors name the bad key
    try:
        if key in _OPTIONAL and raw.lower() in ("none", "null", ""):
            return key, None
        if want is bool:
            low = raw.lower()
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return key, low in ("true", "1", "yes", "on")
        return key, want(raw)
    except ValueError:
        raise ValueError(f"{key}={raw!r}: expected {want.__name__}") from None
