"""`schedtop run`'s workload format, for `schedtop sim`: one workload file serves both.

A run workload gives prompts as text (`prompt`) or chat (`messages`), arrival times in
seconds and sampling parameters; the simulation needs token ids, arrival steps and a
length. The prompts are tokenized with the default model's tokenizer (read from its GGUF
file's metadata in plain Python: no weights, no torch, no numpy), an arrival time t becomes
step round(t * STEPS_PER_S), and each request samples `max_tokens` scripted tokens (token 0,
never a stop token), as a simulated model does. The config is the one `run` would build
(engine.config's knobs, max_model_len capped by the model's context); the runner's knobs
(device, dtype, memory) mean nothing here, and the pool is `num_gpu_blocks_override`
blocks if given, else EngineConfig's num_blocks.

This module sits above both formats: engine.sim.workload and engine.model.workload
import neither it nor each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.model.errors import ModelError, RequestError
from engine.model.workload import RunWorkload, WorkloadRequest, parse_run_workload
from engine.sim.workload import SimRequest, SimWorkload, parse_workload
from engine.workload_file import WorkloadError, read_json

if TYPE_CHECKING:  # `tokenizers` is imported when the first prompt needs it
    from engine.model.tokenizer import ModelTokenizer

STEPS_PER_S = 20  # a simulated step stands for 50 ms of a run's arrival times
DEFAULT_MAX_TOKENS = 16  # `schedtop run`'s default
MAX_STEPS = 100_000  # the driver gives up after this many steps


def load_any_workload(path: str | Path, overrides: dict[str, Any] | None = None) -> SimWorkload:
    """A workload file in either format, as a simulation workload; `overrides` are the
    command line's knobs (`--set`, flags), over the file's."""
    path = Path(path)
    data = read_json(path)
    if is_run_format(data):
        return from_run_format(data, overrides, str(path))
    return parse_workload(data, overrides, str(path))


def is_run_format(data: Any) -> bool:
    """Whether a workload's requests are in `schedtop run`'s format."""
    reqs = data.get("requests") if isinstance(data, dict) else None
    run_keys = {"prompt", "messages", "arrival_time", "sampling"}
    return isinstance(reqs, list) and any(
        isinstance(r, dict) and run_keys.intersection(r) for r in reqs
    )


def from_run_format(
    data: Any,
    overrides: dict[str, Any] | None = None,
    source: str = "workload",
    model: DefaultModel | None = None,
) -> SimWorkload:
    """A run workload as a simulation workload (WorkloadError naming what is wrong)."""
    run = parse_run_workload(data, source)
    try:
        m = model if model is not None else default_model()
        config = sim_config(run, m.context_length, overrides)
        requests = [_request(r, m.tokenizer) for r in run.requests]
    except (ModelError, RequestError) as e:
        raise WorkloadError(f"{source}: {e}") from None
    requests.sort(key=lambda r: r.arrival_step)  # stable: the file's order within a step
    return SimWorkload(run.description, config, MAX_STEPS, requests, source)


def sim_config(
    run: RunWorkload, context_length: int | None, overrides: dict[str, Any] | None = None
) -> EngineConfig:
    """The EngineConfig `run` would build from this workload for a model with this
    context, with the pool `num_gpu_blocks_override` blocks if given."""
    options = run.merged()
    blocks = options.runner.get("num_gpu_blocks_override")
    try:
        config = options.engine_config(context_length)
        if blocks is not None:
            config = config.replace(num_blocks=blocks)
        return config.replace(**(overrides or {}))
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"{run.source}: config: {e}") from None


def _request(r: WorkloadRequest, tok: ModelTokenizer) -> SimRequest:
    if r.prompt_token_ids is not None:
        prompt = list(r.prompt_token_ids)
    elif r.messages is not None:
        prompt = tok.apply_chat_template(r.messages)
    else:
        prompt = tok.encode(r.prompt or "")
    max_tokens = int(r.sampling.get("max_tokens", DEFAULT_MAX_TOKENS))
    if max_tokens < 1:
        raise WorkloadError(f"request {r.id!r}: max_tokens={max_tokens}: must be >= 1")
    return SimRequest(
        r.id,
        round(r.arrival_time * STEPS_PER_S),
        prompt,
        [0] * max_tokens,
        max_tokens,
        r.priority,
        r.tenant,
    )


@dataclass(frozen=True)
class DefaultModel:
    """What the simulation takes from the default model: its tokenizer and context."""

    tokenizer: ModelTokenizer  # prompts to token ids
    context_length: int | None  # caps max_model_len, as in `run`


_DEFAULT: DefaultModel | None = None


def default_model() -> DefaultModel:
    """The default model's tokenizer and context, read once (its GGUF metadata only)."""
    global _DEFAULT
    if _DEFAULT is None:
        from engine.model.gguf_meta import read_metadata, vocab
        from engine.model.loader import default_model_path
        from engine.model.tokenizer import tokenizer_from_gguf

        meta = read_metadata(default_model_path())
        _DEFAULT = DefaultModel(tokenizer_from_gguf(vocab(meta)), meta.context_length())
    return _DEFAULT


def default_tokenizer() -> ModelTokenizer:
    """The default model's tokenizer."""
    return default_model().tokenizer
