"""The one step driver: requests arrive and are aborted when their inputs say, then the
engine steps, until the run is over.

`schedtop sim` (a workload), `resim` (a trace, streamed or read into scripts first),
`whatif` (a trace at its recorded times: the inputs' key is time, not the step) and
`resim --engine vllm` (vLLM's scheduler behind `DrivenEngine`) all run `StepDriver.run`.
Pure Python: `sim` and vLLM's interpreter import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engine.core import EngineCore, StepResult
from engine.records import Arrival
from engine.request import Request

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


def step_limit(num_recorded: int) -> int:
    """How long a re-simulation of `num_recorded` steps may run: a what-if may take many
    times the recorded steps, but not without end."""
    return 10 * num_recorded + 10_000


@dataclass
class RequestScript:
    """Everything the inputs say about one request: how and when it arrives, what it
    samples, when it is aborted (a trace's record of it, or a workload's entry)."""

    arrival: Arrival  # how it arrived
    arrival_step: int  # when
    tokens: list[int] = field(default_factory=list)  # every token it sampled, in order
    accepted: dict[int, int] = field(default_factory=dict)  # output position -> drafts accepted
    proposed: dict[int, int] = field(default_factory=dict)  # output position -> drafts proposed
    status: int = 0  # how it finished (0: it had not when the trace ended)
    abort_step: int = -1  # the step whose record reports its abort (-1: never aborted)
    abort_message: str = ""  # its finish's message
    abort_mid_step: bool = False  # aborted between schedule() and update, not before
    abort_order: int = 0  # its place among that step's finishes: aborts free blocks in order
    hashes: dict[int, bytes] = field(default_factory=dict)  # block index -> recorded hash

    @property
    def request_id(self) -> str:
        return self.arrival.request_id


class Inputs(Protocol):
    """When requests arrive and are aborted (in arrival order; aborts in the recorded
    order, since they free blocks in order), and when the run is over."""

    def arrivals(self, step: int) -> Iterable[RequestScript]: ...

    def aborts(self, step: int, mid_step: bool) -> Iterable[RequestScript]: ...

    def over(self, step: int, requests: bool, batches: bool) -> bool:
        """Whether the run is over before `step`, with requests unfinished or not, and
        batches in flight (async scheduling) or not."""
        ...

    def skip_idle(self) -> bool:
        """With nothing to run after the arrivals and aborts: skip the step (the inputs
        may move their clock to the next arrival) rather than record an empty one."""
        ...


class DrivenEngine(Protocol[R_co]):
    """A scheduler behind the driver: schedtop's EngineCore (`CoreEngine`) or vLLM's."""

    def add(self, script: RequestScript) -> None: ...

    def abort(self, script: RequestScript) -> None: ...

    def unfinished(self) -> tuple[bool, bool]:
        """Whether requests are unfinished, and whether batches are in flight."""
        ...

    def step(self, mid_step: Callable[[], None] | None) -> R_co: ...


class ScriptedInputs:
    """Scripts in arrival order, each due when the clock reaches its key: the step it
    arrived (or was aborted) at, or with `now` and keys in ns, its recorded time."""

    def __init__(
        self,
        scripts: Sequence[RequestScript],
        arrive_at: Sequence[int] | None = None,
        abort_at: dict[int, int] | None = None,
        now: Callable[[int], int] | None = None,
    ) -> None:
        self.scripts = scripts
        self.arrive_at = arrive_at if arrive_at is not None else [s.arrival_step for s in scripts]
        # By step: before the step's schedule(), or in it. By time: all before a step
        # (the clock moves during one; an abort due then waits for the next).
        self.timed = abort_at is not None
        if abort_at is None:
            abort_at = {i: s.abort_step for i, s in enumerate(scripts) if s.abort_step >= 0}
        self._aborts = sorted(
            (t, not self.timed and scripts[i].abort_mid_step, scripts[i].abort_order, i)
            for i, t in abort_at.items()
        )
        self.now = now or (lambda step: step)
        self.next = 0  # the next arrival
        self._next_abort = 0

    # Both return () at once when nothing is due, as on most steps (aborts: twice a step).
    def arrivals(self, step: int) -> Sequence[RequestScript]:
        start, n = self.next, len(self.scripts)
        if start >= n or self.arrive_at[start] > self.now(step):
            return ()
        now = self.now(step)
        while self.next < n and self.arrive_at[self.next] <= now:
            self.next += 1
        return self.scripts[start : self.next]

    def aborts(self, step: int, mid_step: bool) -> Sequence[RequestScript]:
        aborts = self._aborts
        if self._next_abort >= len(aborts) or (mid_step and self.timed):
            return ()
        due, key = [], (self.now(step), mid_step)
        while self._next_abort < len(aborts) and aborts[self._next_abort][:2] <= key:
            due.append(self.scripts[aborts[self._next_abort][3]])
            self._next_abort += 1
        return due

    def over(self, step: int, requests: bool, batches: bool) -> bool:
        return self.next >= len(self.scripts) and not (requests or batches)

    def skip_idle(self) -> bool:
        return False


class StepDriver(Generic[R]):
    """Adds each step's arrivals, then its aborts (a request can arrive and be aborted
    before one step), steps the engine with the mid-step aborts, and yields its result.
    At step `limit` it raises what `stuck(step)` makes: the caller says whose run it was."""

    def __init__(
        self,
        engine: DrivenEngine[R],
        inputs: Inputs,
        limit: int,
        stuck: Callable[[int], BaseException] = lambda step: ValueError(f"running at step {step}"),
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.limit = limit
        self.stuck = stuck
        self.step = 0  # steps run
        self._live: dict[str, RequestScript] = {}  # request id -> the script now using it

    def run(self) -> Iterator[R]:
        engine, inputs = self.engine, self.inputs
        while not inputs.over(self.step, *engine.unfinished()):
            if self.step >= self.limit:
                raise self.stuck(self.step)
            for s in inputs.arrivals(self.step):
                self._live[s.request_id] = s
                engine.add(s)
            self._abort(False)
            if not any(engine.unfinished()) and inputs.skip_idle():
                continue
            yield engine.step(self._abort_mid_step)
            self.step += 1

    def _abort(self, mid_step: bool) -> None:
        for s in self.inputs.aborts(self.step, mid_step):
            if self._live.get(s.request_id) is s:  # ids can be reused: only this request
                self.engine.abort(s)

    def _abort_mid_step(self) -> None:
        self._abort(True)


class CoreEngine:
    """schedtop's EngineCore behind the driver. `hasher` picks each request's block
    hasher; `on_add` sees each script first (a scripted runner learns its tokens)."""

    def __init__(
        self,
        engine: EngineCore,
        hasher: Callable[[RequestScript], Any],
        on_add: Callable[[RequestScript], None] | None = None,
        keep_finished: bool = False,  # else nobody reads them: don't let them pile up
    ) -> None:
        self.engine = engine
        self.hasher = hasher
        self.on_add = on_add
        self.keep_finished = keep_finished

    def add(self, script: RequestScript) -> None:
        if self.on_add is not None:
            self.on_add(script)
        a = script.arrival  # its sampling parameters were validated when it was read
        prompt = a.prompt_token_ids
        self.engine.add_request(
            Request(
                a.request_id,
                list(prompt) if prompt is not None else [0] * a.num_prompt_tokens,
                a.sampling,
                arrival_time=a.arrival_time,
                priority=a.priority,
                eos_token_id=a.eos_token_id,
                block_hasher=self.hasher(script),
                tenant=a.tenant,
            )
        )

    def abort(self, script: RequestScript) -> None:
        self.engine.abort(script.request_id, script.abort_message)

    def unfinished(self) -> tuple[bool, bool]:
        return self.engine.scheduler.has_unfinished(), bool(self.engine.batches)

    def step(self, mid_step: Callable[[], None] | None) -> StepResult:
        result = self.engine.step(mid_step)
        if not self.keep_finished:
            self.engine.take_finished()
        return result
