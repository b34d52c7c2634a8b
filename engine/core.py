"""The engine step loop: schedule, execute, update, report."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Protocol

from engine.config import EngineConfig
from engine.events import NULL_SINK, EventSink
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import Snapshot, Step, ns
from engine.request import Request
from engine.scheduler import Scheduler
from engine.state import snapshot

_REF = attrgetter("ref")


class Runner(Protocol):
    """Executes a SchedulerOutput: the real model, or a simulation of one."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput: ...


class StepResult:
    """What one step produced for callers: its record, the requests it touched, and the
    request id of every ref the record names."""

    __slots__ = ("report", "updated", "_requests", "_names")

    def __init__(
        self, report: Step, updated: list[Request], requests: Sequence[Sequence[Request]]
    ) -> None:
        self.report = report  # the whole record of the step (the explicit form)
        self.updated = updated  # requests that got tokens or finished this step
        self._requests = requests  # every request the record can name
        self._names: dict[int, str] | None = None

    @property
    def names(self) -> dict[int, str]:
        """ref -> request id for every request the step's record names (built on demand:
        most callers never ask)."""
        if self._names is None:
            self._names = {r.ref: r.request_id for group in self._requests for r in group}
        return self._names

    def sampled(self) -> dict[str, list[int]]:
        """The tokens each request sampled this step, by request id, in scheduling order."""
        rep, names = self.report, self.names
        counts = rep.sample_counts or [1] * len(rep.scheduled)
        tokens = rep.sampled_tokens or ()
        out: dict[str, list[int]] = {}
        at = 0
        for entry, count in zip(rep.scheduled, counts):
            if count:
                out[names[entry.ref]] = list(tokens[at : at + count])
                at += count
        return out


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

    @property
    def step_index(self) -> int:
        return self.scheduler.step_index

    @property
    def finished(self) -> dict[str, Request]:
        """Requests finished since the caller last took them, by id (the scheduler's)."""
        return self.scheduler.finished

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        """One iteration: schedule(), the runner, update_from_output(), then one step
        record, assembled from parts that no longer change, for the sink."""
        sched = self.scheduler
        t0 = self.clock()
        out, decided = sched.schedule()
        t1 = self.clock()
        result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
        t2 = self.clock()
        outcome = sched.update_from_output(out, result)
        t3 = self.clock()
        end = sched.end_step()
        report = Step(
            step=decided.step,
            schedule_ns=ns(t1 - t0),
            update_ns=ns(t3 - t2),
            token_budget=self.config.max_num_batched_tokens,
            arrivals=decided.arrivals,
            scheduled=decided.scheduled,
            admissions=decided.admissions,
            preemptions=decided.preemptions,
            shortfalls=decided.shortfalls,
            running_stop=decided.running_stop,
            waiting_stop=decided.waiting_stop,
            finishes=outcome.finishes,
            sample_counts=outcome.sample_counts,
            sampled_tokens=outcome.sampled_tokens,
            spec_accepted=outcome.spec_accepted,
            kv_events=end.kv_events,
            free_blocks_after_schedule=decided.num_free_blocks,
            free_blocks=end.num_free_blocks,
            running=tuple(map(_REF, end.running)),
            waiting=tuple(map(_REF, end.waiting)),
            timings=tuple(result.timings),
        )
        self.sink.on_step(report)
        return StepResult(report, outcome.updated, (end.running, end.waiting, outcome.finished))

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call: by a stop, by an error in add_request or
        schedule(), or by an abort."""
        return self.scheduler.take_finished()

    def snapshot(self) -> Snapshot:
        """The engine's full state now: requests, queues and the block map."""
        return snapshot(self.scheduler)

    def close(self) -> None:
        self.sink.close()
