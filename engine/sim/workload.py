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
from engine.limits import MAX_ID_CHARS, MAX_TOKEN_ID, MAX_TOKENS, check_range
from engine.safe_output import remove_stale_temps

DRIVER_KEYS = ("max_steps",)


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
    return parse_workload(read_json(path), overrides, source=str(path))


def read_json(path: Path) -> Any:
    """A workload file's JSON; every way it can be unreadable is a WorkloadError."""
    try:
        if path.stat().st_size > MAX_WORKLOAD_BYTES:
            raise WorkloadError(f"{path}: larger than {MAX_WORKLOAD_BYTES >> 20} MiB")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such file") from None
    except OSError as e:
        raise WorkloadError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise WorkloadError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise WorkloadError(
            f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise WorkloadError(f"{path}: not valid JSON: nested too deeply") from None


MAX_WORKLOAD_BYTES = 1 << 30  # a workload file is read whole


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
    final = Path(os.path.realpath(path))  # through a link: replace its target, not the link
    remove_stale_temps(final)
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
    if not rid or len(rid) > MAX_ID_CHARS:
        raise WorkloadError(f"{where}: id must have 1 to {MAX_ID_CHARS} characters")
    try:
        rid.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no trace (or terminal) could hold it
        raise WorkloadError(f"{where}: id {rid!r} is not valid Unicode") from None
    return rid, f"{source}: request {rid!r}"


REQUEST_KEYS = frozenset(
    ("id", "arrival_step", "prompt_token_ids", "output_token_ids", "max_tokens", "priority")
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
    )


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
