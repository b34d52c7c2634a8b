"""The simulation workload format (the fidelity cases' format), parsed and validated.

{"description": "...", "config": {engine knobs, plus "max_steps"},
 "requests": [{"id": "A", "arrival_step": 0, "prompt_token_ids": [...],
               "output_token_ids": [...], "max_tokens": 12, "priority": 0}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

from engine.config import EngineConfig

DRIVER_KEYS = ("max_steps", "async_scheduling")


class WorkloadError(ValueError):
    """A workload that cannot be run, with a message naming what is wrong."""


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulation workload."""

    id: str  # request id
    arrival_step: int  # added at the start of this step
    prompt_token_ids: list[int]  # the prompt
    output_token_ids: list[int]  # the script of sampled tokens (padded with 0)
    max_tokens: int  # output tokens, at most
    priority: int  # lower runs first under the priority policy


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
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    return parse_workload(data, overrides, source=str(path))


def parse_workload(
    data: Any, overrides: dict[str, Any] | None = None, source: str = "workload"
) -> SimWorkload:
    """A simulation workload; one in `schedtop run`'s format (text or chat prompts,
    arrival times in seconds) is converted (engine.sim.run_format)."""
    from engine.sim.run_format import from_run_format, is_run_format

    if is_run_format(data):
        return from_run_format(data, overrides, source)
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: expected a JSON object at the top level")
    raw_cfg = data.get("config", {})
    if not isinstance(raw_cfg, dict):
        raise WorkloadError(f"{source}: 'config' must be an object")
    if raw_cfg.get("async_scheduling"):
        raise WorkloadError(f"{source}: config.async_scheduling=true is not supported")
    try:
        config = EngineConfig.from_dict({**raw_cfg, **(overrides or {})}, ignore=DRIVER_KEYS)
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"{source}: config: {e}") from None
    max_steps = _int(raw_cfg.get("max_steps", 100_000), f"{source}: config.max_steps", 1)
    parsed = parse_requests(data, source, _request)
    order = sorted(range(len(parsed)), key=lambda i: (parsed[i].arrival_step, i))
    return SimWorkload(
        str(data.get("description", "")), config, max_steps, [parsed[i] for i in order], source
    )


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


R = TypeVar("R", bound=_HasId)


def parse_requests(
    data: dict[str, Any], source: str, parse: Callable[[Any, int, str], R]
) -> list[R]:
    """A workload's `requests` list, each entry parsed by `parse(entry, index, source)`;
    ids must be unique (both workload formats share this rule)."""
    reqs = data.get("requests")
    if not isinstance(reqs, list):
        raise WorkloadError(f"{source}: 'requests' must be a list")
    parsed = [parse(r, i, source) for i, r in enumerate(reqs)]
    seen: set[str] = set()
    for r in parsed:
        if r.id in seen:
            raise WorkloadError(f"{source}: duplicate request id {r.id!r}")
        seen.add(r.id)
    return parsed


@contextmanager
def atomic_output(path: str | Path) -> Iterator[TextIO]:
    """A text file that appears at `path` only when the block completes: a failed run
    leaves no half-written output (and no temporary file) behind."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            yield f
        os.replace(tmp, final)
    except OSError as e:
        raise WorkloadError(f"{final}: cannot write: {e.strerror}") from None
    finally:
        if tmp.exists():
            tmp.unlink()


def request_id(r: Any, index: int, source: str) -> tuple[str, str]:
    """A request entry's id, and how error messages name the entry from then on."""
    where = f"{source}: requests[{index}]"
    if not isinstance(r, dict):
        raise WorkloadError(f"{where}: expected an object")
    if "id" not in r:
        raise WorkloadError(f"{where}: missing 'id'")
    rid = str(r["id"])
    return rid, f"{source}: request {rid!r}"


def _request(r: Any, index: int, source: str) -> SimRequest:
    rid, where = request_id(r, index, source)
    prompt = _tokens(r.get("prompt_token_ids"), f"{where}: prompt_token_ids")
    outputs = _tokens(r.get("output_token_ids", []), f"{where}: output_token_ids")
    max_tokens = _int(r.get("max_tokens", len(outputs)), f"{where}: max_tokens", 1)
    return SimRequest(
        rid,
        _int(r.get("arrival_step", 0), f"{where}: arrival_step", 0),
        prompt,
        outputs + [0] * (max_tokens - len(outputs)),
        max_tokens,
        _int(r.get("priority", 0), f"{where}: priority", None),
    )


def _int(value: Any, what: str, minimum: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"{what}={value!r}: expected an integer")
    if minimum is not None and value < minimum:
        raise WorkloadError(f"{what}={value}: must be >= {minimum}")
    return value


def _tokens(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise WorkloadError(f"{what}: expected a list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise WorkloadError(f"{what}: {t!r} is not a token id")
    return value
