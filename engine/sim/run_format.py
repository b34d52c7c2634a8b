"""`schedtop run`'s workload format, for `schedtop sim`: one workload file serves both.

A run workload gives prompts as text (`prompt`) or chat (`messages`), arrival times in
seconds and sampling parameters; the simulation needs token ids, arrival steps and a
length. The prompts are tokenized with the default model's tokenizer (read from its GGUF
file: no weights are loaded), an arrival time t becomes step round(t * STEPS_PER_S), and
each request samples `max_tokens` scripted tokens (token 0, never a stop token), as a
simulated model does. Engine options carry over; the runner's (device, dtype, memory)
mean nothing here, and the pool is `num_gpu_blocks_override` blocks if given, else the
engine's default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.sim.workload import SimRequest, SimWorkload, WorkloadError

if TYPE_CHECKING:
    from engine.model.tokenizer import ModelTokenizer
    from engine.model.workload import WorkloadRequest

STEPS_PER_S = 20  # a simulated step stands for 50 ms of a run's arrival times
DEFAULT_MAX_TOKENS = 16  # `schedtop run`'s default
MAX_STEPS = 100_000  # the driver gives up after this many steps


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
    tokenizer: ModelTokenizer | None = None,
) -> SimWorkload:
    """A run workload as a simulation workload (WorkloadError naming what is wrong)."""
    from engine.model.errors import ModelError, RequestError
    from engine.model.workload import ENGINE_ALIASES, RUNNER_KEYS, parse_run_workload

    run = parse_run_workload(data, source)
    options = {ENGINE_ALIASES.get(k, k): v for k, v in run.options.items()}
    blocks = options.pop("num_gpu_blocks_override", None)
    engine = {k: v for k, v in options.items() if k not in RUNNER_KEYS and k != "model"}
    if blocks is not None:
        engine["num_blocks"] = blocks
    try:
        config = EngineConfig.from_dict({**engine, **(overrides or {})})
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"{source}: config: {e}") from None
    try:
        tok = tokenizer if tokenizer is not None else default_tokenizer()
        requests = [_request(r, tok) for r in run.requests]
    except (ModelError, RequestError) as e:
        raise WorkloadError(f"{source}: {e}") from None
    requests.sort(key=lambda r: r.arrival_step)  # stable: the file's order within a step
    return SimWorkload(run.description, config, MAX_STEPS, requests, source)


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
    )


_TOKENIZER: ModelTokenizer | None = None


def default_tokenizer() -> ModelTokenizer:
    """The default model's tokenizer, read once (its GGUF metadata only)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from engine.model.gguf_loader import load_gguf_tokenizer
        from engine.model.loader import default_model_path

        _TOKENIZER = load_gguf_tokenizer(default_model_path())
    return _TOKENIZER
