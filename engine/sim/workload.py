"""The simulation workload format (the fidelity cases' format), parsed and validated.

{"description": "...", "config": {engine knobs, plus "max_steps"},
 "requests": [{"id": "A", "arrival_step": 0, "prompt_token_ids": [...],
               "output_token_ids": [...], "max_tokens": 12, "priority": 0}]}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.limits import MAX_TOKEN_ID, MAX_TOKENS, check_range
from engine.workload_file import WorkloadError, parse_requests, read_json, request_id

DRIVER_KEYS = ("max_steps",)


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulation workload."""

    id: str  # request id
    arrival_step: int  # added at the start of this step
    prompt_token_ids: list[int]  # the prompt
    output_token_ids: list[int]  # the script of sampled tokens (padded with 0)
    max_tokens: int  # output tokens, at most
    priority: int  # lower runs first under the priority policy
    tenant: str | None = None  # whose it is (recorded; `--group-by tenant`)


@dataclass(frozen=True)
class SimWorkload:
    """A parsed workload: engine config, driver limits and requests in arrival order."""

    description: str  # free text
    config: EngineConfig  # validated engine config
    max_steps: int  # the driver gives up after this many steps
    requests: list[SimRequest]  # sorted by (arrival_step, position in the file)
    source: str = ""  # where it came from, for messages


def load_workload(path: str | Path, overrides: dict[str, Any] | None = None) -> SimWorkload:
    """Read and validate a workload file; `overrides` are `--set` values."""
    path = Path(path)
    return parse_workload(read_json(path), overrides, source=str(path))


def parse_workload(
    data: Any, overrides: dict[str, Any] | None = None, source: str = "workload"
) -> SimWorkload:
    """A workload in the simulation's own format (engine.sim.run_format converts
    `schedtop run`'s)."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected a JSON object at the top level")
    raw_cfg = data.get("config", {})
    if not isinstance(raw_cfg, dict):
        raise WorkloadError(f"{source}: 'config' must be an object")
    try:
        config = EngineConfig.from_dict({**raw_cfg, **(overrides or {})}, ignore=DRIVER_KEYS)
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"{source}: config: {e}") from None
    max_steps = _int(raw_cfg.get("max_steps", 100_000), f"{source}: config.max_steps", "max_steps")
    parsed = parse_requests(data, source, _request)
    order = sorted(range(len(parsed)), key=lambda i: (parsed[i].arrival_step, i))
    return SimWorkload(
        str(data.get("description", "")), config, max_steps, [parsed[i] for i in order], source
    )


REQUEST_KEYS = frozenset(
    (
        "id",
        "arrival_step",
        "prompt_token_ids",
        "output_token_ids",
        "max_tokens",
        "priority",
        "tenant",
    )
)


def _request(r: Any, index: int, source: str) -> SimRequest:
    rid, where = request_id(r, index, source)
    unknown = sorted(set(r) - REQUEST_KEYS)
    if unknown:  # a typo (`max_token`) must not pass as a default
        raise WorkloadError(
            f"{where}: unknown field {unknown[0]!r}; known: " + ", ".join(sorted(REQUEST_KEYS))
        )
    prompt = _tokens(r.get("prompt_token_ids"), f"{where}: prompt_token_ids")
    outputs = _tokens(r.get("output_token_ids", []), f"{where}: output_token_ids")
    max_tokens = _int(r.get("max_tokens", len(outputs)), f"{where}: max_tokens", "max_tokens")
    return SimRequest(
        rid,
        _int(r.get("arrival_step", 0), f"{where}: arrival_step", "arrival_step"),
        prompt,
        outputs + [0] * (max_tokens - len(outputs)),
        max_tokens,
        _int(r.get("priority", 0), f"{where}: priority", "priority"),
        tenant(r.get("tenant"), where),
    )


def tenant(value: Any, where: str) -> str | None:
    """A request's `tenant`: a non-empty string of at most 256 characters, or absent."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise WorkloadError(f"{where}: tenant: expected a string of 1 to 256 characters")
    return value


def _int(value: Any, what: str, limit: str) -> int:
    """An integer within engine.limits' range `limit`; `what` names it in messages."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{what}={value!r}: expected an integer")
    try:
        check_range(limit, value, what)
    except ValueError as e:
        raise WorkloadError(str(e)) from None
    return value


def _tokens(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise WorkloadError(f"{what}: expected a list of token ids")
    if len(value) > MAX_TOKENS:
        raise WorkloadError(f"{what}: more than {MAX_TOKENS} tokens")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise WorkloadError(f"{what}: {t!r} is not a token id (0..{MAX_TOKEN_ID})")
    return value
