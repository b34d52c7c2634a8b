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

__all__ = ["Divergence", "ResimError", "ResimResult", "cross_engine_whatif", "resimulate"]


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
            # An SGLang trace (format 1.5): schedtop's scheduler on it is a cross-engine
            # what-if (cross_engine_whatif), never a check that it decides the same.
            raise ResimError(
                f"{path}: a trace of {header.engine} (a token pool, not KV blocks): "
                "schedtop's scheduler does not re-simulate it (it is a what-if: schedtop "
                "resim TRACE --engine schedtop; SGLang's own: --engine sglang)"
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


def cross_engine_config(recorded: dict[str, Any], overrides: dict[str, Any]) -> EngineConfig:
    """schedtop's config for another engine's trace: the header's keys that mean the same
    here (its pool, max_num_seqs, max_model_len, prefix caching), SGLang's own dropped,
    except that SGLang's chunked_prefill_size caps a step's prefill tokens as our
    budget does (its max_prefill_tokens alone would let a step take a whole long prompt)."""
    ours = {k: v for k, v in recorded.items() if not k.startswith("sglang_")}
    chunk = recorded.get("sglang_chunked_prefill_size")
    if isinstance(chunk, int) and chunk > 0:
        seqs = int(ours.get("max_num_seqs", 1))
        ours["max_num_batched_tokens"] = max(min(chunk, ours["max_num_batched_tokens"]), seqs)
    return config_for(ours, overrides)


def cross_engine_whatif(
    path: str | Path, overrides: dict[str, Any] | None, out: str | Path
) -> ResimResult:
    """Another engine's trace (SGLang's) through schedtop's scheduler (vLLM's policy):
    the same requests, prompts and sampled tokens, the config `cross_engine_config` maps,
    run until every request finishes. A what-if: its decisions are expected to differ;
    `replays.diff` compares the two runs."""
    with inputs_checked(path), open_trace(path) as reader:
        header = reader.header
        if header.kv_pool == "blocks":
            raise ResimError(f"{path}: a trace of {header.engine}: re-simulate it instead")
        if header.first_step != 0:
            raise ResimError(f"{path}: the trace starts mid-run (step {header.first_step})")
        config = cross_engine_config(header.config, overrides or {})
        return run_scripted(reader, config, dict(overrides or {}), out, what_if=True)


def run_scripted(
    reader: TraceReader,
    config: EngineConfig,
    overrides: dict[str, Any],
    out: str | Path | None,
    what_if: bool | None = None,
) -> ResimResult:
    """`what_if` (default: with overrides): run every request to its end, even past a
    recording that ended early."""
    with open_trace(reader.path) as again:
        scripts, num_recorded = collect_scripts(again)
    runner = ScriptedRunner(config)
    engine = EngineCore(config, runner)
    driven = scripted_engine(engine, runner, reader.header.redacted)
    driver = StepDriver(
        driven,
        # A check of a recording that ended before its run (killed, or stopped by the
        # recorder) ends where it does; a what-if run goes on to finish its requests.
        RecordedInputs(
            scripts,
            num_recorded,
            reader.footer,
            overrides or ({"what_if": True} if what_if else None),
        ),
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
