"""Run a workload through the engine with the scripted runner, step by step.

Step i adds every request whose arrival_step is i (in file order), then runs one engine
step. The loop ends when every request has finished and no arrival is left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.core import EngineCore, StepResult
from engine.driver import CoreEngine, RequestScript, ScriptedInputs, StepDriver
from engine.events import NULL_SINK, EventSink
from engine.kv.hashing import BlockHasher
from engine.metrics import Lifecycle, Lifecycles, RunMetrics, run_metrics, step_clock
from engine.records import FINISH_REASONS, Arrival, entry_tokens
from engine.request import SamplingParams
from engine.sim.runner import SimRunner
from engine.sim.workload import SimWorkload
from engine.workload_file import WorkloadError

STALL_STEPS = 1000  # steps with nothing scheduled and no arrival left before giving up


@dataclass
class SimSummary:
    """One simulation: its steps folded by engine.metrics (in steps), as `stats` folds
    its trace, plus what only the engine's records say (finish messages)."""

    fold: Lifecycles = field(default_factory=Lifecycles)  # every step, in order
    scheduled_tokens: int = 0  # over the run
    arrival_step: dict[str, int] = field(default_factory=dict)  # from the workload
    finish_reason: dict[str, str] = field(default_factory=dict)  # with error messages

    def observe(self, result: StepResult) -> None:
        rep, names = result.report, result.names
        self.fold.step_explicit(rep)
        self.scheduled_tokens += entry_tokens(rep.scheduled)
        for f in rep.finishes:
            reason = FINISH_REASONS[f.status]
            self.finish_reason[names[f.ref]] = f"{reason}: {f.message}" if f.message else reason

    def metrics(self) -> RunMetrics:
        """The run's figures in steps (docs/metrics.md)."""
        return run_metrics(self.fold, step_clock(self.fold))

    def lives(self) -> dict[str, Lifecycle]:
        """Each request's lifecycle, by id."""
        return {r.request_id: r for r in self.fold.reqs.values()}

    @property
    def num_steps(self) -> int:
        return len(self.fold.steps)

    @property
    def num_preemptions(self) -> int:
        return self.fold.preemptions

    @property
    def first_scheduled(self) -> dict[str, int]:
        return {
            k: r.first_scheduled_step
            for k, r in self.lives().items()
            if r.first_scheduled_step >= 0
        }

    @property
    def first_token(self) -> dict[str, int]:
        return {k: r.sample_steps[0] for k, r in self.lives().items() if r.sample_steps}

    @property
    def finish_step(self) -> dict[str, int]:
        return {k: r.finish_step for k, r in self.lives().items() if r.finish_step >= 0}

    @property
    def preemptions(self) -> dict[str, int]:
        return {k: r.preemptions for k, r in self.lives().items() if r.preemptions}


def make_engine(workload: SimWorkload, sink: EventSink = NULL_SINK) -> EngineCore:
    cfg = workload.config
    runner = SimRunner(
        {r.id: r.output_token_ids for r in workload.requests},
        num_speculative_tokens=cfg.num_speculative_tokens,
        speculative_config=cfg.speculative_config,
        max_model_len=cfg.max_model_len,
    )
    return EngineCore(cfg, runner, sink)


def workload_scripts(workload: SimWorkload) -> list[RequestScript]:
    """The workload's requests as the driver's scripts, in arrival order (a request's
    rank there is its arrival time: the policies' tie-break)."""
    return [
        RequestScript(
            Arrival(
                rank,
                r.id,
                len(r.prompt_token_ids),
                r.priority,
                float(rank),
                None,
                SamplingParams(max_tokens=r.max_tokens),
                tuple(r.prompt_token_ids),
                tenant=r.tenant,
            ),
            r.arrival_step,
            list(r.output_token_ids),
        )
        for rank, r in enumerate(workload.requests)
    ]


def run_steps(workload: SimWorkload, engine: EngineCore) -> Iterator[StepResult]:
    """Drive `engine` through `workload`, yielding each step's result."""
    hasher = BlockHasher(workload.config.block_size)
    scripts = workload_scripts(workload)
    driver = StepDriver(
        CoreEngine(engine, lambda s: hasher, keep_finished=True),
        ScriptedInputs(scripts),
        workload.max_steps,
        lambda step: WorkloadError(f"{workload.source}: still running at max_steps={step}"),
    )
    last_arrival = scripts[-1].arrival_step if scripts else -1
    idle = 0
    for result in driver.run():
        idle = 0 if result.report.scheduled else idle + 1
        if idle >= STALL_STEPS and driver.step > last_arrival:
            raise WorkloadError(
                f"{workload.source}: nothing scheduled for {STALL_STEPS} steps "
                f"at step {driver.step}"
            )
        yield result


def simulate(
    workload: SimWorkload,
    sink: EventSink = NULL_SINK,
    on_step: Callable[[StepResult, EngineCore], None] | None = None,
    on_engine: Callable[[EngineCore], None] | None = None,
) -> SimSummary:
    """Run the whole workload; `on_step` sees every step (decisions writers, tests), and
    `on_engine` the engine before its first step (where observers attach)."""
    engine = make_engine(workload, sink)
    if on_engine is not None:
        on_engine(engine)
    summary = SimSummary()
    summary.arrival_step = {r.id: r.arrival_step for r in workload.requests}
    try:
        for result in run_steps(workload, engine):
            summary.observe(result)
            if on_step is not None:
                on_step(result, engine)
    finally:
        engine.close()
    return summary
