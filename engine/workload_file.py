"""What both workload formats share: reading the file, request ids, WorkloadError, and
output files that appear only when a run succeeds. Plain Python; the run format
(engine.model.workload) and the simulation's (engine.sim.workload) both build on it, and
neither imports the other."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

from engine.errors import UserError
from engine.limits import MAX_ID_CHARS
from engine.safe_output import remove_stale_temps


class WorkloadError(UserError, ValueError):
    """A workload that cannot be run, with a message naming what is wrong."""


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
