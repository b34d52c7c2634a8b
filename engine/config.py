"""The one configuration of the engine and its runner: every knob declared once, with vLLM's
names.

Each knob is a field of EngineConfig (the scheduler and the KV cache) or RunnerOptions (how
the model runs), declared with `knob(default, help, ...)`: its type is the field's, its range
is engine.limits' entry of the same name, and `KNOBS` describes them all. The command
line's flags (`run`, `sim`, `serve`), `--set`, workload files' `config` keys, validation
and docs/workload-format.md's table are all derived from these declarations. Both classes
are frozen and validated once, in `__post_init__`, with ValueErrors naming the field.
Plain Python: the command line and the simulation import it without torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.limits import RANGES, check_range, fmt_bound

POLICIES = ("fcfs", "priority")
SPEC_METHODS = ("ngram",)
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
MAX_MODEL_LEN = 8192  # the default max_model_len, and its cap by a model's context
# vLLM's defaults for these two depend on the entry point and the GPU; `vllm serve`'s on
# most GPUs are taken, for every command (on two CPU cores a 512-token prefill step takes
# about half a second, a 2048-token one roughly four times that: a workload sized for the
# CPU says so in its config, as the built-in one does)
_VLLM_SERVE = "vLLM (`vllm serve`)"


def knob(
    default: Any,
    help: str,
    *,
    flag: str | bool = True,
    vllm: bool | str = True,
    choices: tuple[str, ...] = (),
    aliases: tuple[str, ...] = (),
    shown: str = "",
    bounds: str = "",
    run_key: bool = True,
) -> Any:
    """A config field declared as a knob. `help`: one line, the flag's help and the docs'
    meaning; `flag`: False for none, True for `--the-name`, or the (vLLM) name it is spelled
    as; `vllm`: whether the default is vLLM's (or whose it is, as text); `choices`: a str
    knob's values; `aliases`: other workload spellings; `shown`: the docs' words for a
    computed default; `bounds`: the docs' range of a float knob that __post_init__ checks;
    `run_key`: False for a knob `run` does not take."""
    info = {
        "help": help,
        "flag": flag,
        "vllm": vllm,
        "choices": choices,
        "aliases": aliases,
        "shown": shown,
        "bounds": bounds,
        "run_key": run_key,
    }
    return dataclasses.field(default=default, metadata={"knob": info})


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

    block_size: int = knob(16, "Tokens per KV block.")
    num_blocks: int = knob(
        1024,
        "KV blocks in the pool, including the null block 0 (the simulation's pool; a model's "
        "comes from its memory budget or num_gpu_blocks_override).",
        flag=False,
        vllm=False,
        run_key=False,
    )
    max_num_batched_tokens: int = knob(2048, "Token budget per step.", vllm=_VLLM_SERVE)
    max_num_seqs: int = knob(256, "Cap on running requests.", vllm=_VLLM_SERVE)
    max_num_active_seqs: int | None = knob(
        None, "Cap on admission into running.", vllm=False, shown="max_num_seqs"
    )
    max_model_len: int = knob(
        MAX_MODEL_LEN,
        "Prompt + output tokens, at most.",
        vllm=False,
        shown="the model's context, at most 8192",
    )
    long_prefill_token_threshold: int = knob(
        0, "Tokens one request may compute per step (0: no cap).", shown="0 (off)"
    )
    long_prefill_token_threshold_adaptive: bool = knob(
        False, "Floor the long-prefill cap at the budget over the requests.", vllm=False
    )
    policy: str = knob(
        "fcfs",
        "Scheduling policy: fcfs, or priority (lower `priority` runs first).",
        flag="scheduling_policy",
        choices=POLICIES,
        aliases=("scheduling_policy",),
    )
    enable_prefix_caching: bool = knob(True, "Reuse KV blocks of shared prefixes.")
    enable_chunked_prefill: bool = knob(
        True, "Split long prompts over steps; off: a prompt that does not fit the budget waits."
    )
    watermark: float = knob(
        0.0,
        "Fraction of blocks kept free when admitting beside running requests.",
        vllm=False,
        bounds="[0, 1)",
    )
    scheduler_reserve_full_isl: bool = knob(
        True, "Admit a request only if its whole prompt fits in the KV cache.", vllm=False
    )
    num_speculative_tokens: int = knob(
        0,
        "Draft tokens per decode step (from speculative_config; alone: simulated drafts).",
        flag=False,
        vllm=False,
        shown="0 (off)",
    )
    speculative_config: SpeculativeConfig | None = knob(
        None,
        "Speculative decoding as vLLM spells it (JSON), e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 1}.',
        shown="none (off)",
    )
    async_scheduling: bool = knob(
        False,
        "Schedule the next step before the last one's samples are back (vLLM 0.33: on).",
        vllm=False,
    )

    def __post_init__(self) -> None:
        self._spec_config()
        check_fields(self)
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= max_num_seqs ({self.max_num_seqs})",
        )
        if self.max_num_active_seqs is not None:
            _require(
                self.max_num_active_seqs <= self.max_num_seqs,
                "max_num_active_seqs",
                self.max_num_active_seqs,
                f"must be in [1, max_num_seqs={self.max_num_seqs}]",
            )
        _require(
            self.long_prefill_token_threshold <= self.max_model_len,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            f"must be in [0, max_model_len={self.max_model_len}]",
        )
        _require(0.0 <= self.watermark < 1.0, "watermark", self.watermark, "must be in [0, 1)")
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
        """Accept the JSON object (a workload) or its text (a trace header, a flag); the
        drafter's k is the scheduler's lookahead, so the two spellings must agree."""
        spec = self.speculative_config
        if spec is None:
            return
        if isinstance(spec, str):
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

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold tokens (the null block never does)."""
        return self.num_blocks - 1

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with `changes` applied; unknown keys are a ValueError."""
        unknown = sorted(set(changes) - set(ENGINE_KNOBS))
        if unknown:
            raise ValueError(
                f"unknown config key {unknown[0]!r}; known keys: " + ", ".join(sorted(ENGINE_KNOBS))
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


@dataclass(frozen=True)
class RunnerOptions:
    """How and where the model runs (the scheduler's knobs are EngineConfig's)."""

    device: str = knob(
        "auto", "Where the model runs: auto (CUDA if present), cpu, cuda.", choices=DEVICES
    )
    dtype: str = knob(
        "auto",
        "Weights and activations: auto (float32 on CPU, bfloat16 on CUDA), float32, "
        "bfloat16, float16.",
        choices=DTYPES,
    )
    attention_backend: str = knob(
        "auto",
        "Attention: auto (the C kernel over the paged cache on CPU, Triton on CUDA), cpu, "
        "torch, triton.",
        choices=ATTENTION_BACKENDS,
    )
    kv_cache_memory: int | None = knob(
        None,
        "KV pool size on CPU: bytes, or 512MiB, 2GiB, 1.5GB.",
        vllm=False,
        shown="1GiB",
    )
    gpu_memory_utilization: float = knob(
        0.9, "CUDA: fraction of GPU memory for weights, activations and KV.", bounds="(0, 1]"
    )
    num_gpu_blocks_override: int | None = knob(
        None, "KV blocks (including the null block 0), ignoring the memory budget.", shown="none"
    )
    profile_every: int = knob(
        0,
        "Every Nth step carries a torch.profiler breakdown (0: off).",
        vllm=False,
        shown="0 (off)",
    )
    seed: int = knob(0, "Seed of the generator of requests without their own seed.")
    num_threads: int | None = knob(
        None,
        "CPU threads: by default one or all cores, whichever the runner measures faster.",
        vllm=False,
        shown="measured",
    )
    adaptive_drafts: bool | None = knob(
        None,
        "With speculative_config: send only the drafts a request's recent acceptance makes "
        "worth verifying (false: all of them, as vLLM does).",
        vllm=False,
        shown="true on CPU, false on CUDA",
    )

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):  # a workload's or a flag's "2GiB"
            object.__setattr__(
                self, "kv_cache_memory", _size("kv_cache_memory", self.kv_cache_memory)
            )
        check_fields(self)
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "must be in (0, 1]",
        )


@dataclass(frozen=True)
class Knob:
    """One config field as the outside sees it: a flag, a `--set` key, a workload key."""

    name: str  # the field's name: a workload `config` key and a `--set` key
    owner: str  # "engine" (EngineConfig) or "runner" (RunnerOptions)
    type: Any  # int, float, bool, str, or SpeculativeConfig (JSON)
    optional: bool  # None is a value (derived or measured where it is needed)
    default: Any  # the one default of every command
    help: str  # one line: the flag's help and the docs table's meaning
    flag: str | None  # the command line's spelling, vLLM's where it has the knob ("--block-size")
    origin: str  # whose default it is: "vLLM", "vLLM (`vllm serve`)" or "schedtop"
    choices: tuple[str, ...]  # the allowed values of a str knob
    aliases: tuple[str, ...]  # other workload spellings (vLLM's name where the field differs)
    shown: str  # how the docs show a default that is computed ("" = the value)
    bounds: str  # the docs' range of a float knob checked in __post_init__ ("" = none)
    run_key: bool  # a `run` workload key and flag (False: the pool size, measured by the runner)

    @property
    def shown_default(self) -> str:
        """The default as the docs and `--help` show it."""
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)

    @property
    def range(self) -> tuple[float, float] | None:
        """engine.limits' range of a numeric knob."""
        return RANGES.get(self.name)

    def parse(self, raw: str) -> Any:
        """A value from text (`--set`, a sweep grid); ValueError naming the knob."""
        raw = raw.strip()
        if self.type is SpeculativeConfig:
            return SpeculativeConfig.from_json(raw)  # its errors name the bad key
        if self.optional and raw.lower() in ("none", "null", ""):
            return None
        try:
            if self.type is bool:
                low = raw.lower()
                if low not in _TRUE + _FALSE:
                    raise ValueError
                return low in _TRUE
            if self.name == "kv_cache_memory":
                return _size(self.name, raw)
            return self.type(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected {self.type.__name__}") from None


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _knobs(cls: type, owner: str) -> dict[str, Knob]:
    hints = typing.get_type_hints(cls)
    out: dict[str, Knob] = {}
    for f in dataclasses.fields(cls):
        info = f.metadata["knob"]
        args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
        flag = info["flag"]
        out[f.name] = Knob(
            name=f.name,
            owner=owner,
            type=args[0] if args else hints[f.name],
            optional=bool(args),
            default=f.default,
            help=info["help"],
            flag=None
            if flag is False
            else "--" + (f.name if flag is True else flag).replace("_", "-"),
            origin=_origin(info["vllm"]),
            choices=info["choices"],
            aliases=info["aliases"],
            shown=info["shown"],
            bounds=info["bounds"],
            run_key=info["run_key"],
        )
    return out


def _origin(vllm: bool | str) -> str:
    return vllm if isinstance(vllm, str) else "vLLM" if vllm else "schedtop"


ENGINE_KNOBS = _knobs(EngineConfig, "engine")
RUNNER_KNOBS = _knobs(RunnerOptions, "runner")
KNOBS: dict[str, Knob] = {**ENGINE_KNOBS, **RUNNER_KNOBS}  # every knob, in declaration order
ALIASES = {a: k.name for k in KNOBS.values() for a in k.aliases}


def check_fields(obj: Any) -> None:
    """Each knob of `obj` against its type, its choices and engine.limits' range."""
    for k in (ENGINE_KNOBS if isinstance(obj, EngineConfig) else RUNNER_KNOBS).values():
        value = getattr(obj, k.name)
        if (value is None and k.optional) or k.type is SpeculativeConfig:
            continue
        if k.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(obj, k.name, value)
        if not isinstance(value, k.type) or (k.type is not bool and isinstance(value, bool)):
            raise ValueError(f"{k.name}={value!r}: expected {k.type.__name__}")
        if k.choices and value not in k.choices:
            raise ValueError(f"{k.name}={value!r}: must be one of {', '.join(k.choices)}")
        if k.range is not None:
            check_range(k.name, value)


def docs_table() -> str:
    """docs/workload-format.md's table of knobs (a test keeps the two equal)."""
    rows = [
        "| key | flag | default | default's origin | range | meaning |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in KNOBS.values():
        key = f"`{k.name}`" + "".join(f" (or `{a}`)" for a in k.aliases)
        flag = "-" if k.flag is None else f"`{k.flag}`"
        if k.flag is not None and k.type is bool:
            flag = f"`{k.flag}/--no-{k.flag[2:]}`"
        if k.choices:
            bounds = ", ".join(f"`{c}`" for c in k.choices)
        elif k.type is bool:
            bounds = "true, false"
        elif k.range is not None:
            bounds = f"{fmt_bound(k.range[0])} .. {fmt_bound(k.range[1])}"
        else:
            bounds = k.bounds or "-"
        rows.append(f"| {key} | {flag} | {k.shown_default} | {k.origin} | {bounds} | {k.help} |")
    return "\n".join(rows) + "\n"


def knob_named(key: str) -> Knob:
    """The knob a key names (vLLM's alias or dashes allowed); unknown keys are a ValueError."""
    name = key.strip().replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in KNOBS:
        raise ValueError(f"unknown config key {key!r}; known keys: " + ", ".join(sorted(KNOBS)))
    return KNOBS[name]


def parse_setting(text: str) -> tuple[str, Any]:
    """One `KEY=VALUE` of `--set` (an EngineConfig knob) as a typed pair."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {text!r}: expected KEY=VALUE")
    try:
        k = knob_named(key)
    except ValueError:
        k = None
    if k is None or k.owner != "engine":
        raise ValueError(
            f"unknown config key {key.strip()!r}; known keys: " + ", ".join(sorted(ENGINE_KNOBS))
        )
    return k.name, k.parse(raw)


@dataclass(frozen=True)
class Options:
    """A run's knobs as given, by field name: the defaults fill in the rest."""

    engine: dict[str, Any]  # EngineConfig fields
    runner: dict[str, Any]  # RunnerOptions fields

    def engine_config(self, max_position: int | None = None) -> EngineConfig:
        """The EngineConfig; unless given, max_model_len is the model's context (its
        `max_position` tokens) up to MAX_MODEL_LEN."""
        values = dict(self.engine)
        if max_position is not None:
            values.setdefault("max_model_len", min(MAX_MODEL_LEN, max_position))
        return EngineConfig().replace(**values)

    def runner_options(self) -> RunnerOptions:
        return RunnerOptions(**self.runner)


def split_options(*layers: Mapping[str, Any]) -> Options:
    """Merge the option layers of `run`'s format (a workload's config, then the flags;
    None = not given) by knob name, aliases resolved. num_blocks is not among them: a
    model's pool is sized by kv_cache_memory or num_gpu_blocks_override."""
    engine: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            k = KNOBS.get(ALIASES.get(key, key))
            if k is None or not k.run_key:
                known = [n for n, o in KNOBS.items() if o.run_key] + list(ALIASES)
                raise ValueError(f"unknown option {key!r}; known: " + ", ".join(sorted(known)))
            if value is not None:
                (engine if k.owner == "engine" else runner)[k.name] = value
    return Options(engine, runner)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "tb": 10**12,
}


def parse_size(text: str | int) -> int:
    """Bytes from '4GiB', '512MB', '1.5g' or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r}: expected a size such as 4GiB, 512MB or a byte count")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{text!r}: must be > 0")
    return value


def _size(name: str, text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise ValueError(f"{name}={e}") from None


def _require(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {why}")
