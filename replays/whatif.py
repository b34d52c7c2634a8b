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

import dataclasses
import functools
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.driver import RequestScript, ScriptedInputs, StepDriver, step_limit
from engine.metrics import GroupMetrics, group_metrics
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import Timing
from recorder.reader import TraceReader
from recorder.schema import Header
from replays.costmodel import CostModel, format_model, step_work
from replays.groups import GroupBy, format_group_change
from replays.resim_base import Checker, ResimError, config_for, inputs_checked, recorder_for
from replays.scripts import ScriptCollector, ScriptedRunner, scripted_engine
from replays.timebase import (
    Observer,
    Timebase,
    TimedMetrics,
    observe_trace,
    recorded_timebase,
    timed_clock,
    timed_metrics,
    why_untimed,
)

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
    first_difference: int | None  # first step whose decisions differ (None: none, or unchecked)
    out: Path | None  # where the predicted trace went
    group_by: GroupBy | None = None  # --group-by: each side's groups below
    recorded_groups: list[GroupMetrics] | None = None
    predicted_groups: list[GroupMetrics] | None = None

    def to_json(self) -> dict[str, Any]:
        """`schedtop whatif --json`."""
        out: dict[str, Any] = {
            "trace": self.trace,
            "changed": self.changed,
            "model": self.model.to_json(),
            "recorded": self.recorded.to_json(),
            "predicted": self.predicted.to_json(),
            "first_difference": self.first_difference,
        }
        if self.group_by is not None:
            out["group_by"] = self.group_by.spec
            for side, groups in (
                ("recorded_groups", self.recorded_groups),
                ("predicted_groups", self.predicted_groups),
            ):
                out[side] = [g.to_json() for g in groups or ()]
        return out

    def format(self) -> str:
        """What `schedtop whatif` prints: the model, recorded vs predicted, decisions."""
        changed = ", ".join(f"{k}={v}" for k, v in self.changed.items()) or "the recorded config"
        first = self.first_difference
        return "\n".join(
            [
                f"predicted {self.predicted.num_steps} steps ({self.recorded.num_steps} "
                f"recorded) with {changed}",
                format_model(self.model),
                "",
                format_result(self),
                "",
                "decisions: identical to the recording"
                if first is None
                else f"decisions: first differ at step {first}",
            ]
            + self._groups()
        )

    def _groups(self) -> list[str]:
        if self.group_by is None or self.recorded_groups is None:
            return []
        table = format_group_change(
            self.group_by,
            self.recorded_groups,
            self.predicted_groups or [],
            "s",
            ("rec", "pred"),
        )
        return ["", table]


def whatif(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    model: CostModel | None = None,
    out: str | Path | None = None,
    check: bool = True,
    min_r2: float | None = None,
    group_by: GroupBy | None = None,
) -> WhatifResult:
    """Predict the trace at `path` under its config with `overrides`, with `model`
    (default: fitted on the trace's own timings); write the predicted trace to `out`.
    `check` compares each predicted step's decisions with the recording's (sweeps, which
    only want the metrics, skip it). `min_r2`: refuse a fitted model whose held-out R² is
    below it (WhatifError). `group_by`: each group's figures too, on both sides."""
    with inputs_checked(path):
        inputs = _inputs(path)
    obs = inputs.obs
    if inputs.first_step != 0:
        raise WhatifError(
            f"{path}: the trace starts mid-run (step {inputs.first_step}); "
            "what-if needs every arrival from step 0"
        )
    if model is None:
        if not obs.timed:
            raise WhatifError(
                f"{path}: {why_untimed(path)}: give a step-time model with "
                "--model FILE or --model intercept=S,prefill_tokens=S,..."
            )
        model = obs.fit(str(path))
    if min_r2 is not None and model.fit is not None and model.fit.trust_r2 < min_r2:
        raise WhatifError(
            f"{path}: the step-time model's R² on held-out steps is {model.fit.trust_r2:.3f}, "
            f"below --min-r2 {min_r2}: its predictions are not to be trusted"
        )
    base, recorded = inputs.recorded(model)
    config = config_for(inputs.header.config, overrides or {})
    run = _TimedRun(inputs, config, model, base)
    with inputs_checked(path):
        predicted, differs = run.run(out, check)
    result = WhatifResult(
        str(path),
        config,
        dict(overrides or {}),
        model,
        recorded,
        predicted,
        differs,
        Path(out) if out is not None else None,
    )
    if group_by is not None:
        result.group_by = group_by
        rec_clock = timed_clock(obs, base.end_ns, base.arrival_ns, base.start_ns)
        result.recorded_groups = _ordered(group_by, group_metrics(obs, rec_clock, group_by.key))
        pred_clock = timed_clock(run.obs, run.obs.end_ns, base.arrival_ns)
        result.predicted_groups = _ordered(
            group_by, group_metrics(run.obs, pred_clock, group_by.key)
        )
    return result


def _ordered(by: GroupBy, groups: list[GroupMetrics]) -> list[GroupMetrics]:
    found = {g.key: g for g in groups}
    return [found[k] for k in by.order(list(found))]


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


Work = tuple[int, int, int, int, int]  # a step's FEATURES
NO_WORK: Work = (0, 0, 0, 0, 0)


class _TimedRunner(ScriptedRunner):
    """The scripted runner, plus the model's time for each step it executes."""

    def __init__(self, config: EngineConfig, model: CostModel, clock: _Clock) -> None:
        super().__init__(config)
        self.model = model
        self.clock = clock
        self.work = NO_WORK  # the last executed step's; the driver resets it before a step
        self.first = True  # the next step executed is the engine's first: it warms up

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        self.work = work = scheduled_work(out)
        ns = self.model.predict_ns(work, self.first)
        self.first = False
        self.clock.charge(ns)
        result.timings = [Timing(out.step, 0, ns, None, 0)]
        return result


def scheduled_work(out: SchedulerOutput) -> Work:
    """`step_work` of what a SchedulerOutput schedules (the same FEATURES as its step
    record's entries give), without a pass per entry when no drafts are verified."""
    tokens = out.num_scheduled_tokens
    spec = out.scheduled_spec_decode_tokens
    cached = out.scheduled_cached_reqs
    if spec:
        before = {nr.req_id: nr.num_computed_tokens for nr in out.scheduled_new_reqs}
        before.update(zip(cached.req_ids, cached.num_computed_tokens))
        return step_work((n, len(spec.get(rid, ())), before[rid]) for rid, n in tokens.items())
    total = out.total_num_scheduled_tokens
    context = total + sum(cached.num_computed_tokens)
    for nr in out.scheduled_new_reqs:
        context += nr.num_computed_tokens
    decodes = list(tokens.values()).count(1)
    return total - decodes, decodes, 0, context, len(tokens)


class _TimedRun:
    """The predicted run: arrivals and aborts at their times, one engine step at a time.

    Its metrics come from the engine's own step records (explicit: no reducer needed);
    a recorder runs only to write `out` or to compare each step with the recording."""

    def __init__(
        self, inputs: _Inputs, config: EngineConfig, model: CostModel, base: Timebase
    ) -> None:
        self.inputs = inputs
        self.config = config
        self.base = base
        self.clock = _Clock(model.predict_ns((0, 0, 0, 0, 0)))
        self.runner = _TimedRunner(config, model, self.clock)
        self.engine = EngineCore(config, self.runner, clock=self.clock.seconds)
        self.core = scripted_engine(self.engine, self.runner, inputs.header.redacted)
        self.obs = Observer(config.num_blocks - 1)

    def run(self, out: str | Path | None, check: bool) -> tuple[TimedMetrics, int | None]:
        header = self.inputs.header
        with ExitStack() as stack:
            checker = None
            if check:
                recorded = stack.enter_context(TraceReader(self.inputs.path))
                checker = Checker(recorded.steps())
            if out is not None or checker is not None:
                recorder = recorder_for(self.engine, header, out, checker, self.clock.settle)
                stack.callback(recorder.close)
            self._drive()
        first = None
        if checker is not None:
            d = checker.divergence
            if d is not None:
                first = d.step
            elif checker.steps < self.inputs.num_steps:
                first = checker.steps
        return timed_metrics(self.obs, self.obs.end_ns, self.base.arrival_ns), first

    def _drive(self) -> None:
        # A simulated trace's driver steps through idle time (each empty step costs the
        # model's empty-step time).
        inputs = _TimedInputs(self.inputs.scripts, self.base, self.clock, not self.inputs.obs.timed)
        limit = step_limit(self.inputs.num_steps)
        for _ in StepDriver(self, inputs, limit, _stuck).run():
            pass

    # -- the engine behind the driver: the scripted one, on the model's clock ---------------

    def add(self, script: RequestScript) -> None:
        self.core.add(script)

    def abort(self, script: RequestScript) -> None:
        # No message: it would say when the recorded abort came, not this one.
        self.engine.abort(script.request_id)

    def unfinished(self) -> tuple[bool, bool]:
        return self.engine.scheduler.has_unfinished(), bool(self.engine.batches)

    def step(self, mid_step: Callable[[], None] | None) -> None:
        idle = not self.engine.has_unfinished()
        self.clock.begin_step()
        self.runner.work = NO_WORK
        result = self.core.step(mid_step)
        self.obs.observe_explicit(result.report, self.clock.settle(), idle, self.runner.work)


def _stuck(step: int) -> WhatifError:
    return WhatifError(f"the predicted run is still going at step {step}")


class _TimedInputs(ScriptedInputs):
    """Arrivals and aborts at their recorded times, on the predicted run's clock."""

    def __init__(
        self, scripts: list[RequestScript], base: Timebase, clock: _Clock, idle_steps: bool
    ) -> None:
        super().__init__(scripts, base.arrival_ns, base.abort_ns, lambda step: clock.now)
        self.clock = clock
        self.idle_steps = idle_steps

    def skip_idle(self) -> bool:
        if self.next >= len(self.scripts):
            return True  # none left: the run is over
        if self.idle_steps:
            return False
        self.clock.now = self.arrive_at[self.next]  # a real engine sleeps until then
        return True


@dataclass
class _Inputs:
    """What a what-if reads from a trace, once per process per trace (a sweep runs the
    same trace under many configs)."""

    path: str  # the trace
    header: Header  # its header
    obs: Observer  # its steps, observed
    first_step: int  # its first step
    scripts: list[RequestScript]  # per-request scripts (resim's), by ref
    num_steps: int  # step records
    on_clock: dict[tuple[float, ...], tuple[Timebase, TimedMetrics]] = field(
        default_factory=dict
    )  # model vector -> the recording on that model's clock, and its metrics

    def recorded(self, model: CostModel) -> tuple[Timebase, TimedMetrics]:
        """The recording's timebase and metrics under `model` (computed once per model:
        every config of a sweep compares with the same recording)."""
        key = (*model.vector, model.warmup_s)
        if key not in self.on_clock:
            base = recorded_timebase(self.obs, model)
            self.on_clock[key] = (
                base,
                timed_metrics(self.obs, base.end_ns, base.arrival_ns, base.start_ns),
            )
        base, metrics = self.on_clock[key]
        return base, dataclasses.replace(metrics)


def _inputs(path: str | Path) -> _Inputs:
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise WhatifError(f"{path}: cannot read: {e.strerror}") from None
    return _read_inputs(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_inputs(path: str, size: int, mtime_ns: int) -> _Inputs:
    with TraceReader(path) as reader:
        header = reader.header
    # One pass: the scripts are built from the same reduced steps the observer reads
    # (a trace that starts mid-run has no scripts: what-if refuses it).
    collector = ScriptCollector(header.redacted) if header.first_step == 0 else None
    obs, first_step = observe_trace(path, collector.add if collector else None)
    if collector is None:
        return _Inputs(path, header, obs, first_step, [], 0)
    return _Inputs(path, header, obs, first_step, collector.scripts, collector.steps)


# -- the table ----------------------------------------------------------------------------------


def format_result(r: WhatifResult) -> str:
    """Recorded vs predicted, side by side, with the prediction's relative change (or,
    with no overrides, its error against the recording)."""
    label = "error" if not r.changed else "change"
    rows = [("metric", "recorded", "predicted", label)]
    for name in METRICS:
        a, b = getattr(r.recorded, name), getattr(r.predicted, name)
        rows.append((name, format_metric(name, a), format_metric(name, b), _delta(a, b)))
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


def format_metric(name: str, v: float | int | None) -> str:
    """One of METRICS as the tables show it (times in ms)."""
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
