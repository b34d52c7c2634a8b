"""What-if in time: re-simulate a trace with its arrivals at their recorded times and a
clock advanced by a step-time model (`replays.costmodel`).

`resim` replays arrivals at their recorded *steps*, which answers "which decisions
change" but not "how much sooner": with another budget steps take longer or shorter, so
requests arrive at other steps, and the decisions follow. Here each request is added at
the first step boundary at or after its recorded arrival time, every step advances the
clock by the model's prediction for the work it scheduled, and the predicted run is
recorded like any trace (its steps carry the predicted time), so `stats`, `diff`,
`export` and the TUI read it.

Like `resim`, the one other module of `replays` that drives the engine (a re-simulation
with a clock); it reuses resim's per-request scripts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, RunnerTimings, SchedulerOutput
from recorder.reader import TraceReader
from recorder.recorder import Recorder
from recorder.schema import Step
from recorder.writer import NullWriter, TraceWriter
from replays.costmodel import CostModel, fit_model, step_work
from replays.diff import differing_fields
from replays.reducer import apply_with_view
from replays.resim import (
    ResimError,
    _collect,
    _config,
    _fill_redacted,
    _RecordedHasher,
    _request,
    _ScriptedRunner,
)
from replays.state import State
from replays.timebase import Observer, Timebase, TimedMetrics, recorded_timebase, timed_metrics

METRICS = (
    "throughput",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "tpot_p99",
    "itl_p50",
    "itl_p99",
    "queue_p50",
    "queue_p99",
    "preemptions",
    "recompute_tokens",
    "peak_blocks",
)


class WhatifError(ResimError):
    """A trace or a model that a time-driven re-simulation cannot use."""


@dataclass
class WhatifResult:
    """A time-driven re-simulation and the recording it was compared with."""

    trace: str  # the recorded trace
    config: EngineConfig  # the config it ran with
    changed: dict[str, Any]  # the overrides applied to the recorded config
    model: CostModel  # the step-time model
    recorded: TimedMetrics  # the recording, on its clock (a sim trace: on the model's)
    predicted: TimedMetrics  # the predicted run
    first_difference: int | None  # first step whose decisions differ (None: none differ)
    out: Path | None  # where the predicted trace went


def whatif(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    model: CostModel | None = None,
    out: str | Path | None = None,
) -> WhatifResult:
    """Predict the trace at `path` under its config with `overrides`, with `model`
    (default: fitted on the trace's own timings); write the predicted trace to `out`."""
    obs, first_step = _observe(path)
    if first_step != 0:
        raise WhatifError(
            f"{path}: the trace starts mid-run (step {first_step}); "
            "what-if needs every arrival from step 0"
        )
    if model is None:
        if not obs.timed:
            raise WhatifError(
                f"{path}: the trace has no step timings (a simulated run): give a step-time "
                "model with --model FILE or --model intercept=S,prefill_tokens=S,..."
            )
        work, secs, excluded = obs.fit_rows()
        model = fit_model(work, secs, str(path), excluded)
    base = recorded_timebase(obs, model)
    recorded = timed_metrics(obs, base.end_ns, base.arrival_ns)
    with TraceReader(path) as reader:
        config = _config(reader.header.config, overrides or {})
        run = _TimedRun(reader, config, model, base, out, idle_steps=not obs.timed)
        predicted, differs = run.run()
    return WhatifResult(
        str(path),
        config,
        dict(overrides or {}),
        model,
        recorded,
        predicted,
        differs,
        Path(out) if out is not None else None,
    )


def _observe(path: str | Path) -> tuple[Observer, int]:
    from replays.timebase import observe_trace

    return observe_trace(path)


class _Clock:
    """The predicted run's clock, integer ns. A step's time is charged when the runner
    executes it; an empty step (the runner is not called) is charged when the recorder
    reads the clock at its end, or when the step returns."""

    def __init__(self, empty_ns: int) -> None:
        self.now = 0
        self.empty_ns = empty_ns
        self.pending = False

    def begin_step(self) -> None:
        self.pending = True

    def charge(self, ns: int) -> None:
        self.now += ns
        self.pending = False

    def settle(self) -> int:
        if self.pending:
            self.charge(self.empty_ns)
        return self.now

    def seconds(self) -> float:
        # EngineCore times schedule() and update_from_output() with this: both take no
        # predicted time (the model's step time covers them), so they record 0.
        return self.now / 1e9


class _TimedRunner(_ScriptedRunner):
    """The scripted runner, plus the model's time for each step it executes."""

    def __init__(self, k: int, model: CostModel, clock: _Clock) -> None:
        super().__init__(k)
        self.model = model
        self.clock = clock

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        before = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = out.scheduled_spec_decode_tokens
        work = step_work(
            (n, len(spec.get(rid, ())), before[rid]) for rid, n in out.num_scheduled_tokens.items()
        )
        ns = self.model.predict_ns(work)
        self.clock.charge(ns)
        result.timings = [RunnerTimings(out.step, 0.0, ns / 1e9, None, 0.0)]
        return result


class _TimedRun:
    """The predicted run: arrivals and aborts at their times, one engine step at a time."""

    def __init__(
        self,
        reader: TraceReader,
        config: EngineConfig,
        model: CostModel,
        base: Timebase,
        out: str | Path | None,
        idle_steps: bool,
    ) -> None:
        self.reader = reader
        self.config = config
        self.base = base
        # A simulated trace's driver steps through idle time (each empty step costs the
        # model's empty-step time); a real engine sleeps until the next arrival.
        self.idle_steps = idle_steps
        self.clock = _Clock(model.predict_ns((0, 0, 0, 0, 0)))
        self.runner = _TimedRunner(config.num_speculative_tokens, model, self.clock)
        self.engine = EngineCore(config, self.runner, clock=self.clock.seconds)
        header = reader.header
        self.obs = Observer(config.num_blocks - 1)
        own = replace(
            header,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            policy=config.policy,
        )
        self.state = State.initial(own)
        self.recorded = _steps(TraceReader(reader.path))
        self.first_difference: int | None = None
        sink = TraceWriter(out, live=False) if out is not None else NullWriter()
        self.recorder = Recorder(
            self.engine,
            sink,
            redact_prompts=header.redacted,
            snapshot_interval=header.snapshot_interval,
            model=header.model,
            on_step_record=self._on_record,
            clock=self.clock.settle,
        )

    def _on_record(self, rec: Step) -> None:
        idle = not self.state.requests
        self.obs.observe(rec, apply_with_view(self.state, rec), idle)
        if self.first_difference is None:
            old = next(self.recorded, None)
            if old is None or differing_fields(old, rec):
                self.first_difference = rec.step

    def run(self) -> tuple[TimedMetrics, int | None]:
        try:
            self._drive()
        finally:
            self.recorder.close()
        if self.first_difference is None and next(self.recorded, None) is not None:
            self.first_difference = len(self.obs.steps)
        ends = self.obs.end_ns
        return timed_metrics(self.obs, ends, self.base.arrival_ns), self.first_difference

    def _drive(self) -> None:
        scripts, num_recorded = _collect(TraceReader(self.reader.path))
        engine, clock, base = self.engine, self.clock, self.base
        redacted = self.reader.header.redacted
        plain = BlockHasher(self.config.block_size)
        live: dict[str, int] = {}
        aborts = sorted((t, ref) for ref, t in base.abort_ns.items())
        limit = 10 * num_recorded + 10_000
        nxt = 0  # next arrival (ref)
        done_aborts = 0
        while nxt < len(scripts) or engine.has_unfinished():
            if engine.step_index >= limit:
                raise WhatifError(f"the predicted run is still going at step {engine.step_index}")
            while nxt < len(scripts) and base.arrival_ns[nxt] <= clock.now:
                s = scripts[nxt]
                a = s.arrival
                self.runner.add_script(a.request_id, _fill_redacted(s) if redacted else s.tokens)
                self.runner.accepted[a.request_id] = list(s.accepted)
                live[a.request_id] = nxt
                hasher = _RecordedHasher(self.config.block_size, s, nxt) if redacted else plain
                engine.add_request(_request(a, hasher))
                nxt += 1
            while done_aborts < len(aborts) and aborts[done_aborts][0] <= clock.now:
                ref = aborts[done_aborts][1]
                rid = scripts[ref].arrival.request_id
                if live.get(rid) == ref:
                    engine.abort(rid)
                done_aborts += 1
            if not engine.has_unfinished():
                if nxt >= len(scripts):
                    break
                if not self.idle_steps:
                    clock.now = base.arrival_ns[nxt]
                    continue
            clock.begin_step()
            engine.step()
            clock.settle()
            engine.take_finished()


def _steps(reader: TraceReader) -> Any:
    with reader:
        for entry in reader.entries():
            if isinstance(entry.record, Step):
                yield entry.record


# -- the table ----------------------------------------------------------------------------------


def format_result(r: WhatifResult) -> str:
    """Recorded vs predicted, side by side, with the prediction's relative change (or,
    with no overrides, its error against the recording)."""
    label = "error" if not r.changed else "change"
    rows = [("metric", "recorded", "predicted", label)]
    for name in METRICS:
        a, b = getattr(r.recorded, name), getattr(r.predicted, name)
        rows.append((name, _fmt(name, a), _fmt(name, b), _delta(a, b)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(name: str, v: float | int | None) -> str:
    if v is None:
        return "-"
    if name == "throughput":
        return f"{v:.1f} tok/s"
    if isinstance(v, int):
        return str(v)
    return f"{v * 1e3:.1f} ms"


def _delta(a: float | int | None, b: float | int | None) -> str:
    if a is None or b is None:
        return "-"
    if a == 0:
        return "0%" if b == 0 else "new"
    return f"{(b - a) / a:+.1%}"
