"""The engine step loop: schedule, execute, update, report."""

from __future__ import annotations

import time
from collections import deque
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
        # Async scheduling: executed batches whose update is still to come, oldest first.
        self.batches: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @property
    def step_index(self) -> int:
        return self.scheduler.step_index

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        if request.is_finished:
            self.finished[request.request_id] = request

    def abort(self, request_id: str, message: str = "") -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.scheduler.abort(request_id, message):
            return False
        self.finished[request_id] = request
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batches)

    def step(self, mid_step: Callable[[], None] | None = None) -> StepResult:
        """One iteration: schedule(), the runner, update_from_output(), then the report.
        `mid_step` runs between the runner and the update, where vLLM's engine core
        applies the aborts that came in while the model ran (re-simulations use it)."""
        sched = self.scheduler
        if self.config.async_scheduling:
            return self._step_async(mid_step)
        t0 = self.clock()
        out, report = sched.schedule()
        t1 = self.clock()
        result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
        self._mid_step(mid_step, report)
        t2 = self.clock()
        updated = sched.update_from_output(out, result, report)
        t3 = self.clock()
        return self._end_step(report, result, updated, t1 - t0, t3 - t2)

    def _mid_step(self, mid_step: Callable[[], None] | None, report: StepReport) -> None:
        if mid_step is not None:
            finishes = len(self.finished)
            mid_step()
            if len(self.finished) != finishes:
                # An abort after schedule() can take out one of the leading decodes.
                report.num_leading_decodes = -1

    def _step_async(self, mid_step: Callable[[], None] | None = None) -> StepResult:
        """One iteration with two batches in flight, as vLLM's EngineCore with async
        scheduling (step_with_batch_queue): schedule and launch this step's batch, then
        apply the oldest batch's samples, unless the queue is not full yet and there is
        more to schedule. The step's report carries the samples that arrived in it."""
        sched = self.scheduler
        batches = self.batches
        t0 = self.clock()
        busy = sched.has_unfinished() or sched.has_unreported_finishes
        out, report = sched.schedule()
        t1 = self.clock()
        if busy or not batches:
            result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
            batches.append((out, result))
            if len(batches) < 2 and (not out.is_empty or sched.has_unfinished()):
                return self._end_step(report, result, [], t1 - t0, 0.0)
        self._mid_step(mid_step, report)
        t2 = self.clock()
        old_out, old_result = batches.popleft()
        updated = sched.update_from_output(old_out, old_result, report)
        t3 = self.clock()
        return self._end_step(report, old_result, updated, t1 - t0, t3 - t2)

    def _end_step(
        self,
        report: StepReport,
        result: ModelRunnerOutput,
        updated: list[Request],
        schedule_s: float,
        update_s: float,
    ) -> StepResult:
        sched = self.scheduler
        sched.end_step(report)
        report.schedule_s = schedule_s
        report.update_s = update_s
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
