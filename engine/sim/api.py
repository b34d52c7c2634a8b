"""`schedtop sim` as one library call."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from engine.config import parse_setting
from engine.core import EngineCore, StepResult
from engine.events import NULL_SINK, EventSink
from engine.sim.decisions import decision_record
from engine.sim.driver import SimSummary, simulate
from engine.sim.run_format import load_any_workload
from engine.sim.workload import SimWorkload
from engine.workload_file import WorkloadError, atomic_output


def demo_workload_path() -> Path:
    """The built-in demo workload shipped with the package."""
    return Path(str(resources.files("engine") / "data" / "demo_workload.json"))


def parse_settings(settings: Iterable[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for text in settings:
        try:
            key, value = parse_setting(text)
        except ValueError as e:
            raise WorkloadError(f"--set: {e}") from None
        out[key] = value
    return out


def load(
    path: str | Path | None, settings: Iterable[str] = (), flags: dict[str, Any] | None = None
) -> SimWorkload:
    """The workload at `path` (either format; default: the demo) with the command line's
    knobs over its config: `flags` (None = not given), then `--set`'s `settings`."""
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    return load_any_workload(path or demo_workload_path(), {**given, **parse_settings(settings)})


def run_sim(
    workload: SimWorkload,
    decisions_path: str | Path | None = None,
    sink: EventSink = NULL_SINK,
    on_engine: Callable[[EngineCore], None] | None = None,
) -> SimSummary:
    """Simulate `workload`; write the decisions file only if the whole run succeeds.
    `on_engine` gets the engine before its first step (a recorder attaches there)."""
    if decisions_path is None:
        return simulate(workload, sink, on_engine=on_engine)
    with atomic_output(decisions_path) as f:

        def write(result: StepResult, engine: EngineCore) -> None:
            f.write(json.dumps(decision_record(result, engine)) + "\n")

        return simulate(workload, sink, on_step=write, on_engine=on_engine)
