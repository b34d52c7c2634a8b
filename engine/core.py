"""The engine step loop: schedule, execute, update, report."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.events import NULL_SINK, EventSink
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import Sample, Scheduled, Snapshot, Step, entry_refs, ns
from engine.request import Request
from engine.rules import layout_samples
from engine.scheduler import Outcome, Scheduler
from engine.state import snapshot
from engine.stats import Admitted, EngineStats, StepStats
from engine.version import schedtop_version

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

    def stats(self) -> StepStats:
        """The step in the terms a server's metrics count (engine.stats)."""
        rep = self.report
        by_ref = {r.ref: r for group in self._requests for r in group}
        admitted = tuple(
            Admitted(
                request_id=by_ref[a.ref].request_id,
                num_prompt_tokens=by_ref[a.ref].num_prompt_tokens,
                num_cached_tokens=a.cached_tokens,
                resumed=a.resumed,
            )
            for a in rep.admissions
        )
        return StepStats(rep.num_scheduled_tokens, len(rep.preemptions), admitted)

    def sampled(self) -> dict[str, list[int]]:
        """The tokens each request sampled this step, by request id, in scheduling order."""
        rep, names = self.report, self.names
        counts = rep.sample_counts or [1] * len(rep.scheduled)
        tokens = rep.sampled_tokens or ()
        out: dict[str, list[int]] = {}
        at = 0
        for ref, count in zip(entry_refs(rep.scheduled), counts):
            if count:
                out[names[ref]] = list(tokens[at : at + count])
                at += count
        for s in rep.other_samples:  # async scheduling: samples of an earlier batch
            out[names[s.ref]] = list(s.token_ids or ())
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
        # The clock arrivals are stamped with, where the engine stamps them (LLMEngine sets
        # it); None: the caller orders arrivals its own way (the simulation: by rank). A
        # recorder notes its reading at time 0, so that arrivals land on the trace's clock.
        self.arrival_clock: Callable[[], float] | None = None
        # The clock's reading when the last step's work ended (its update done, before its
        # report): the instant a recorder writes as the step's time and a server's metrics
        # take as its end, so that the two agree to the nanosecond however late either
        # thread gets the interpreter back.
        self.last_end = 0.0
        self.scheduler = Scheduler(config)
        # Async scheduling: executed batches whose update is still to come, oldest first.
        self.batches: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @property
    def step_index(self) -> int:
        return self.scheduler.step_index

    @property
    def finished(self) -> dict[str, Request]:
        """Requests finished since the caller last took them, by id (the scheduler's)."""
        return self.scheduler.finished

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str, message: str = "") -> bool:
        return self.scheduler.abort(request_id, message)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batches)

    @property
    def has_unreported(self) -> bool:
        """Arrivals or aborts that no step has reported yet."""
        return self.scheduler.has_unreported

    def has_work(self) -> bool:
        """Requests to run, or something to report (arrivals, aborts and the blocks they
        freed) even with nothing to run: a step now would not be empty for the trace."""
        return self.has_unfinished() or self.scheduler.has_unreported

    def describe(self) -> tuple[str, str]:
        """The engine and the model it runs, as a trace's header names them."""
        model = getattr(self.runner, "model_description", "")  # a real model's runner's
        name = f"schedtop {schedtop_version()} ({type(self.runner).__name__})"
        return name, model if isinstance(model, str) else ""

    def stats(self) -> EngineStats:
        """The engine's load now (engine.stats), for metrics and back-pressure."""
        sched = self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_free_blocks=sched.kv.num_free_blocks,
            num_usable_blocks=self.config.usable_blocks,
        )

    def step(self, mid_step: Callable[[], None] | None = None) -> StepResult:
        """One iteration: schedule(), the runner, update_from_output(), then one step
        record, assembled from parts that no longer change, for the sink. `mid_step` runs
        between the runner and the update, where vLLM's engine core applies the aborts
        that came in while the model ran (re-simulations use it)."""
        sched = self.scheduler
        if self.config.async_scheduling:
            return self._step_async(mid_step)
        t0 = self.clock()
        out, decided = sched.schedule()
        t1 = self.clock()
        result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
        if mid_step is not None:
            mid_step()
        t2 = self.clock()
        outcome = sched.update_from_output(out, result)
        self.last_end = t3 = self.clock()
        return self._report(decided, outcome, result, ns(t1 - t0), ns(t3 - t2), ns(t3 - t0))

    def _step_async(self, mid_step: Callable[[], None] | None) -> StepResult:
        """One iteration with two batches in flight, as vLLM's EngineCore with async
        scheduling (step_with_batch_queue): schedule and launch this step's batch, then
        apply the oldest batch's samples, unless the queue is not full yet and there is
        more to schedule. The step's record carries the samples that arrived in it."""
        sched = self.scheduler
        batches = self.batches
        t0 = self.clock()
        busy = sched.has_unfinished() or sched.has_unreported_finishes
        out, decided = sched.schedule()
        t1 = self.clock()
        if busy or not batches:
            result = self.runner.execute(out) if not out.is_empty else ModelRunnerOutput([], [])
            batches.append((out, result))
            if len(batches) < 2 and (not out.is_empty or sched.has_unfinished()):
                finishes, finished = sched.take_finishes()
                none_yet = (0,) * len(decided.scheduled) if decided.scheduled else None
                nothing = Outcome(finishes, finished, none_yet, (), (), [])
                self.last_end = end = self.clock()
                work = ns(end - t0)  # schedule and launch: this step's work
                return self._report(decided, nothing, result, ns(t1 - t0), 0, work)
        if mid_step is not None:
            mid_step()
        t2 = self.clock()
        old_out, old_result = batches.popleft()
        outcome = sched.update_from_output(old_out, old_result)
        self.last_end = t3 = self.clock()
        return self._report(
            decided, outcome, old_result, ns(t1 - t0), ns(t3 - t2), ns(t3 - t0), old_out
        )

    def _report(
        self,
        decided: Any,
        outcome: Outcome,
        result: ModelRunnerOutput,
        schedule_ns: int,
        update_ns: int,
        work_ns: int,
        batch: SchedulerOutput | None = None,
    ) -> StepResult:
        sched = self.scheduler
        end = sched.end_step()
        counts, tokens = outcome.sample_counts, outcome.sampled_tokens
        others: tuple[Sample, ...] = ()
        if batch is not None:
            counts, tokens, others = _regroup(decided.scheduled, batch, outcome)
        report = Step(
            step=decided.step,
            schedule_ns=schedule_ns,
            update_ns=update_ns,
            token_budget=self.config.max_num_batched_tokens,
            arrivals=decided.arrivals,
            scheduled=decided.scheduled,
            admissions=decided.admissions,
            preemptions=decided.preemptions,
            shortfalls=decided.shortfalls,
            running_stop=decided.running_stop,
            waiting_stop=decided.waiting_stop,
            finishes=outcome.finishes,
            sample_counts=counts,
            sampled_tokens=tokens,
            other_samples=others,
            spec_accepted=outcome.spec_accepted,
            spec_proposed=outcome.spec_proposed,
            kv_events=end.kv_events,
            free_blocks_after_schedule=decided.num_free_blocks,
            free_blocks=end.num_free_blocks,
            running=tuple(map(_REF, end.running)),
            waiting=tuple(map(_REF, end.waiting)),
            timings=tuple(result.timings),
            # The engine's work (schedule, the runner, update), apart from any wait before
            # step() was called: what a step's duration means (docs/metrics.md). Taken from
            # the clock reads above: one more read per step would move every step time of
            # a run on a scripted clock.
            work_ns=work_ns,
        )
        self.sink.on_step(report)
        return StepResult(
            report, outcome.updated, (end.running, end.waiting, outcome.finished, outcome.updated)
        )

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call: by a stop, by an error in add_request or
        schedule(), or by an abort."""
        return self.scheduler.take_finished()

    def snapshot(self) -> Snapshot:
        """The engine's full state now: requests, queues and the block map."""
        return snapshot(self.scheduler)

    def close(self) -> None:
        self.sink.close()


def _regroup(
    scheduled: Sequence[Scheduled], batch: SchedulerOutput, outcome: Outcome
) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[Sample, ...]]:
    """Async: samples of an earlier batch, laid out against this step's entries (a record
    holds samples per scheduled entry, and other_samples for requests without one)."""
    ids = list(batch.num_scheduled_tokens)
    counts = outcome.sample_counts or (1,) * len(ids)
    refs = {r.request_id: r.ref for r in outcome.updated}
    tokens = outcome.sampled_tokens
    by_ref: dict[int, tuple[int, ...]] = {}
    at = 0
    for rid, count in zip(ids, counts):
        if count:
            by_ref[refs[rid]] = tuple(tokens[at : at + count])
            at += count
    return layout_samples(entry_refs(scheduled), by_ref)
