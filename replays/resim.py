"""Re-simulation: drive today's Scheduler with a trace's inputs (docs/contracts.md R3).

The trace's arrivals (with their sampling parameters and priorities), its sampled tokens,
its aborts and its speculative-decoding acceptances go through the real scheduler and KV
manager with a model-free runner. With the recorded config every decision must come out
the same; the first step that does not is reported. With `overrides` ("what if the budget
were 1024?") the result is a new trace to compare.

Two runners serve the two cases:
- Faithful (recorded config, token ids recorded): streams the trace once and hands each
  step's recorded samples to the scheduled requests in scheduling order. It reads each
  record once, so it keeps pace with the simulated engine itself.
- Scripted (overrides, redacted traces, or after a divergence): reads the whole trace
  first into per-request scripts (tokens, acceptances, aborts, and for redacted traces the
  recorded block hashes), then runs like `schedtop sim`.

Both drive the engine with engine.driver's StepDriver, as `sim`, `whatif` and the vLLM
driver do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.driver import StepDriver, step_limit
from recorder.multi import open_trace
from recorder.reader import TraceReader
from replays.resim_base import (
    Checker,
    Divergence,
    ResimError,
    ResimResult,
    config_for,
    inputs_checked,
    recorder_for,
)
from replays.resim_faithful import run_faithful
from replays.scripts import RecordedInputs, ScriptedRunner, collect_scripts, scripted_engine

__all__ = ["Divergence", "ResimError", "ResimResult", "resimulate"]


def resimulate(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    scripted: bool = False,
    max_steps: int | None = None,
) -> ResimResult:
    """Re-simulate the trace at `path`, with `overrides` applied to its config; write the
    new trace to `out` if given. `scripted` skips the faithful runner (tests use it);
    `max_steps` stops a faithful re-simulation early (benchmarks use it).

    A trace whose inputs drive the scheduler into an error (a crafted one: a sample for a
    request that never arrived, say) is a TraceError, whatever the engine raised."""
    with inputs_checked(path):
        return _resimulate(path, overrides, out, scripted, max_steps)


def _resimulate(
    path: str | Path,
    overrides: dict[str, Any] | None,
    out: str | Path | None,
    scripted: bool,
    max_steps: int | None,
) -> ResimResult:
    with open_trace(path) as reader:
        header = reader.header
        if header.first_step != 0:
            raise ResimError(
                f"{path}: the trace starts mid-run (step {header.first_step}); "
                "re-simulation needs every arrival from step 0"
            )
        if header.kv_pool != "blocks":
            # An SGLang trace (format 1.5): schedtop's scheduler on it would be a
            # cross-engine what-if, not a re-simulation, and is not built yet (issue 29).
            raise ResimError(
                f"{path}: a trace of {header.engine} (a token pool, not KV blocks): "
                "schedtop's scheduler cannot re-simulate it yet"
            )
        config = config_for(header.config, overrides or {})
        # With async scheduling a step's samples arrive a step later: only the scripted
        # runner (tokens per request, not per step) can hand them out.
        scripted = scripted or config.async_scheduling
        if not overrides and not header.redacted and not scripted:
            result = run_faithful(reader, config, out, max_steps)
            if result.reproduced or max_steps is not None:
                return result
        return run_scripted(reader, config, dict(overrides or {}), out)


def run_scripted(
    reader: TraceReader, config: EngineConfig, overrides: dict[str, Any], out: str | Path | None
) -> ResimResult:
    with open_trace(reader.path) as again:
        scripts, num_recorded = collect_scripts(again)
    runner = ScriptedRunner(config)
    engine = EngineCore(config, runner)
    driven = scripted_engine(engine, runner, reader.header.redacted)
    driver = StepDriver(
        driven,
        # A check of a recording that ended before its run (killed, or stopped by the
        # recorder) ends where it does; a what-if run goes on to finish its requests.
        RecordedInputs(scripts, num_recorded, reader.footer, overrides),
        step_limit(num_recorded),
        lambda step: ResimError(f"the re-simulation is still running at step {step}"),
    )
    with open_trace(reader.path) as recorded:  # compared step by step as the run goes
        checker = Checker(recorded.steps())
        recorder = recorder_for(engine, reader.header, out, checker)
        try:
            for _ in driver.run():
                pass
        finally:
            recorder.close()
    if checker.divergence is None and checker.steps < num_recorded:
        checker.divergence = Divergence(checker.steps, ("steps",), None, None)
    return ResimResult(
        config,
        overrides,
        num_recorded,
        checker.steps,
        checker.divergence,
        Path(out) if out else None,
        "scripted",
    )
