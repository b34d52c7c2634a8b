"""The scripted re-simulation runner: for overrides, redacted traces, or after a
divergence. It reads the whole trace first into per-request scripts (tokens,
acceptances, aborts, and for redacted traces the recorded block hashes), then drives them
at their recorded steps like `schedtop sim`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.driver import ScriptedInputs, StepDriver, step_limit
from recorder.multi import open_trace
from recorder.reader import TraceReader
from replays.resim_base import Checker, Divergence, ResimError, ResimResult, recorder_for
from replays.scripts import ScriptedRunner, collect_scripts, scripted_engine


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
        ScriptedInputs(scripts),
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
