"""The real engine's workload format, parsed and validated (plain Python: no torch).

    {"description": "...",
     "config": {engine and runner options, vLLM's names, e.g. "max_num_seqs": 32},
     "requests": [{"id": "r1", "messages": [{"role": "user", "content": "Hi"}],
                   "arrival_time": 0.5, "sampling": {"max_tokens": 64, "temperature": 0}}]}

A request gives exactly one of `prompt` (text), `messages` (chat, through the model's
template) or `prompt_token_ids`. A malformed file is a WorkloadError; a well-formed
request the engine cannot serve (empty prompt, max_tokens < 1, too long) is refused at
run time and reported with finish_reason "error", and the others go on."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import Options, split_options
from engine.limits import check_range
from engine.workload_file import WorkloadError, parse_requests, read_json, request_id

SAMPLING_KEYS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "ignore_eos": bool,
    "stop_token_ids": list,
    "priority": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "min_p": float,
    "logit_bias": list,
    "logprobs": int,
}


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a real-engine workload."""

    id: str  # request id
    prompt: str | None = None  # text prompt
    messages: list[dict[str, str]] | None = None  # chat messages
    prompt_token_ids: list[int] | None = None  # pre-tokenized prompt
    arrival_time: float = 0.0  # seconds after the start of the run
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    priority: int = 0  # lower runs first under the priority policy
    tenant: str | None = None  # whose it is (recorded; `--group-by tenant`)

    @property
    def prompt_input(self) -> Any:
        """Whichever prompt form the request gave."""
        if self.messages is not None:
            return self.messages
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        return self.prompt


@dataclass(frozen=True)
class RunWorkload:
    """A parsed workload: options as given (validated when the engine is built) and
    requests in arrival order."""

    description: str  # free text
    options: dict[str, Any]  # the `config` knobs as given (engine.config's names or aliases)
    requests: list[WorkloadRequest]  # sorted by arrival_time (stable)
    source: str = "workload"  # where it came from, for messages
    model: str | None = None  # the `config`'s model path, if any

    def merged(self, *flags: dict[str, Any]) -> Options:
        """The knobs: the file's, then `flags` (None = not given) over them."""
        return run_options(self.options, *flags, where=f"{self.source}: config")


def load_run_workload(path: str | Path) -> RunWorkload:
    path = Path(path)
    return parse_run_workload(read_json(path), str(path))


def parse_run_workload(data: Any, source: str = "workload") -> RunWorkload:
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected a JSON object at the top level")
    options = data.get("config", {})
    if not isinstance(options, dict):
        raise WorkloadError(f"{source}: 'config' must be an object")
    options = dict(options)
    model = options.pop("model", None)
    if model is not None and not isinstance(model, str):
        raise WorkloadError(f"{source}: config: model={model!r}: expected a path")
    run_options(options, where=f"{source}: config")  # names now, values when the engine is built
    parsed = parse_requests(data, source, _request)
    parsed.sort(key=lambda r: r.arrival_time)
    return RunWorkload(str(data.get("description", "")), options, parsed, source, model)


def run_options(*layers: dict[str, Any], where: str = "option") -> Options:
    """Option layers (a file's config, then flags) merged by knob name; an unknown key or
    one `run` does not take is a WorkloadError."""
    try:
        return split_options(*layers)
    except ValueError as e:
        raise WorkloadError(f"{where}: {e}") from None


def _request(r: Any, index: int, source: str) -> WorkloadRequest:
    rid, where = request_id(r, index, source)
    unknown = set(r) - {
        "id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "arrival_time",
        "sampling",
        "tenant",
    }
    if unknown:
        raise WorkloadError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in r]
    if len(given) != 1:
        raise WorkloadError(
            f"{where}: give exactly one of 'prompt', 'messages', 'prompt_token_ids'"
        )
    arrival = r.get("arrival_time", 0.0)
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)):
        raise WorkloadError(f"{where}: arrival_time={arrival!r}: expected seconds >= 0")
    _check(where, "arrival_time", float(arrival), "arrival_time")
    sampling = _sampling(r.get("sampling", {}), where)
    priority = sampling.pop("priority", 0)
    _check(where, "sampling.priority", priority, "priority")
    return WorkloadRequest(
        rid,
        prompt=_prompt(r, where),
        messages=_messages(r, where),
        prompt_token_ids=_token_ids(r, where),
        arrival_time=float(arrival),
        sampling=sampling,
        priority=priority,
        tenant=_tenant(r.get("tenant"), where),
    )


def _tenant(value: Any, where: str) -> str | None:
    """A request's `tenant`: a non-empty string of at most 256 characters, or absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise WorkloadError(f"{where}: tenant: expected a string of 1 to 256 characters")
    return value


def _prompt(r: dict[str, Any], where: str) -> str | None:
    value = r.get("prompt")
    if value is not None and not isinstance(value, str):
        raise WorkloadError(f"{where}: 'prompt' must be a string")
    return value


def _messages(r: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    value = r.get("messages")
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    ):
        raise WorkloadError(
            f"{where}: 'messages' must be a list of {{role, content}} objects with string values"
        )
    return value


def _token_ids(r: dict[str, Any], where: str) -> list[int] | None:
    value = r.get("prompt_token_ids")
    if value is None:
        return None
    if not isinstance(value, list) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in value
    ):
        raise WorkloadError(f"{where}: 'prompt_token_ids' must be a list of integers")
    return value


def _check(where: str, key: str, value: float, limit: str) -> None:
    """engine.limits' range `limit`, as a WorkloadError naming the request and key."""
    try:
        check_range(limit, value, key)
    except ValueError as e:
        raise WorkloadError(f"{where}: {e}") from None


def _sampling(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WorkloadError(f"{where}: 'sampling' must be an object")
    out: dict[str, Any] = {}
    for key, raw in value.items():
        want = SAMPLING_KEYS.get(key)
        if want is None:
            raise WorkloadError(
                f"{where}: sampling: unknown key {key!r}; known: " + ", ".join(SAMPLING_KEYS)
            )
        if want is float and isinstance(raw, int) and not isinstance(raw, bool):
            raw = float(raw)
        if key in ("seed", "logprobs") and raw is None:
            out[key] = None
            continue
        ok = isinstance(raw, want) and not (want is not bool and isinstance(raw, bool))
        if not ok:
            raise WorkloadError(f"{where}: sampling.{key}={raw!r}: expected {want.__name__}")
        if key == "stop_token_ids":
            if any(isinstance(t, bool) or not isinstance(t, int) for t in raw):
                raise WorkloadError(f"{where}: sampling.stop_token_ids must be integers")
            raw = tuple(raw)
        if key == "logit_bias":
            raw = _bias(raw, where)
        out[key] = raw
    return out


def _bias(raw: list[Any], where: str) -> tuple[tuple[int, float], ...]:
    """logit_bias as [[token_id, bias], ...] (the trace's form; ranges: SamplingParams)."""
    out = []
    for pair in raw:
        ok = isinstance(pair, list) and len(pair) == 2
        token, bias = pair if ok else (None, None)
        if not ok or isinstance(token, bool) or not isinstance(token, int):
            raise WorkloadError(f"{where}: sampling.logit_bias must be [token_id, bias] pairs")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise WorkloadError(f"{where}: sampling.logit_bias: bias {bias!r} is not a number")
        out.append((token, float(bias)))
    return tuple(out)
