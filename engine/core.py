"""The engine step loop: schedule, execute, update, report."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.events import NULL_SINK, EventSink
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.report import StepReport
from engine.request import Request
from engine.scheduler import Scheduler
from engine.state import EngineState, snapshot


class Runner(Protocol):
    """Executes a SchedulerOutput: the real model, or a simulation of one."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step produced for callers."""

    report: StepReport  # the whole record of the step
    updated: list[Request]  # requests that got tokens or finished this step


class EngineCore:
    """Drives a Scheduler and a Runner one step at a time and reports every step to a sink.

    It knows nothing of who listens: a recorder attaches itself as the sink."""

    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        sink: EventSink = NULL_SINK,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config
        self.runner = runner
        self.sink = sink
        self.clock = clock
        self.scheduler = Scheduler(config)
        self.finished: dict[str, Request] = {}  # finished since the caller last took them

    @property
    def step_index(self) -> int:
        return self.scheduler.step_index

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.is_finished:
            self.finished[request.request_id] = request

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.abort(request_id):
            return False
        self.finished[request_id] = request
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        """One iteration: schedule(), the runner, update_from_output(), then the report."""
        sched = self.scheduler
        t0 = self.clock()
        out, report = sched.schedule()
        t1 = self.clock()
        result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
        t2 = self.clock()
        updated = sched.update_from_output(out, result, report)
        t3 = self.clock()
        sched.end_step(report)
        report.schedule_s = t1 - t0
        report.update_s = t3 - t2
        report.timings = result.timings
        for req in updated:
            if req.is_finished:
                self.finished[req.request_id] = req
        self.sink.on_step(report)
        return StepResult(report, updated)

    def take_finished(self) -> list[Request]:
        done = list(self.finished.values())
        self.finished.clear()
        return done

    def snapshot(self, ref_cnts: bool = True) -> EngineState:
        """The engine's full state now: requests, queues and the block map."""
        return snapshot(self.scheduler, ref_cnts)

    def close(self) -> None:
        self.sink.close()
