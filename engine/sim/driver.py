"""Run a workload through the engine with the scripted runner, step by step.

Step i adds every request whose arrival_step is i (in file order), then runs one engine
step. The loop ends when every request has finished and no arrival is left."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.core import EngineCore, StepResult
from engine.events import NULL_SINK, EventSink
from engine.kv.hashing import BlockHasher
from engine.metrics import Lifecycle, Lifecycles, RunMetrics, run_metrics, step_clock
from engine.records import Status
from engine.request import FINISH_REASONS, Request, SamplingParams
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
        self.scheduled_tokens += sum(s.num_tokens for s in rep.scheduled)
        for f in rep.finishes:
            reason = FINISH_REASONS[Status(f.status)]
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


def make_request(r, rank: int, hasher: BlockHasher) -> Request:  # type: ignore[no-untyped-def]
    return Request(
        r.id,
        r.prompt_token_ids,
        SamplingParams(max_tokens=r.max_tokens),
        arrival_time=float(rank),
        priority=r.priority,
        block_hasher=hasher,
    )


def run_steps(
    workload: SimWorkload, engine: EngineCore, on_arrival: Callable[[Request], None] | None = None
) -> Iterator[StepResult]:
    """Drive `engine` through `workload`, yielding each step's result."""
    hasher = BlockHasher(workload.config.block_size)
    arrivals: dict[int, list[Request]] = {}
    for rank, r in enumerate(workload.requests):
        arrivals.setdefault(r.arrival_step, []).append(make_request(r, rank, hasher))
    last_arrival = max(arrivals, default=-1)
    step = idle = 0
    while step <= last_arrival or engine.has_unfinished():
        if step >= workload.max_steps:
            raise WorkloadError(
                f"{workload.source}: still running at max_steps={workload.max_steps}"
            )
        for req in arrivals.pop(step, ()):
            engine.add_request(req)
            if on_arrival is not None:
                on_arrival(req)
        result = engine.step()
        idle = 0 if result.report.scheduled else idle + 1
        if idle >= STALL_STEPS and step > last_arrival:
            raise WorkloadError(
                f"{workload.source}: nothing scheduled for {STALL_STEPS} steps at step {step}"
            )
        yield result
        step += 1


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
