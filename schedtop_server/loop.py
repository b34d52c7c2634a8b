"""The engine loop: one thread owns the LLMEngine and everything it touches.

The asyncio side never calls the engine. It puts commands on a thread-safe queue (add a
request, abort one, report a finished HTTP exchange) and reads per-request asyncio queues
that this thread fills, once per step for all requests, through `call_soon_threadsafe`.
Between steps the thread drains the commands, so requests from many clients join the
running batch at the next step, exactly like a `schedtop run` workload."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from engine.metrics import LiveMetrics
from engine.model.errors import RequestError
from engine.outputs import TokenLogprobs
from engine.records import Client
from engine.request import SamplingParams
from schedtop_server.detok import IncrementalDetokenizer, StopStrings

if TYPE_CHECKING:
    from engine.model.llm_engine import LLMEngine, Prompt, RequestOutput
    from engine.records import Step
    from engine.stats import StepStats
    from schedtop_server.metrics import ServeMetrics

log = logging.getLogger("schedtop.serve")
T = TypeVar("T")

IDLE_INTERVAL_S = 0.1  # an idle engine still calls on_idle this often
# Woken from idle by a request, the engine waits for more before its first step:
# COALESCE_STEP_FRACTION of a recent step's wall time, at most COALESCE_MAX_S, less once
# max_num_seqs requests are in. Clients that start together (vllm bench serve at a fixed
# concurrency, each of its waves) arrive over some milliseconds; without the wait the
# first is prefilled alone and the rest a step later. With fixed output lengths that
# split never heals: the first one finishes a step before the others, its successor is
# again prefilled alone, and every wave pays a step in which nothing else advances (a
# step's cost on a CPU hardly depends on its batch). Profiled under vllm bench serve:
# 15 of 16 requests arrived 40-90 ms after the first, 33 steps a wave instead of 32. The
# wait costs a request that finds the engine idle that much TTFT, never a busy engine.
COALESCE_STEP_FRACTION = 0.25
COALESCE_MAX_S = 0.05
STEP_TIME_WEIGHT = 0.2  # of the newest step in the running mean of a step's wall time
TOKENIZER_THREADS = 2  # prompts tokenized at once, off the engine thread
# A test hook (tests/test_flight_recorder.py): after this many steps the engine thread
# stops stepping for good, as a hung model call stops it, while the HTTP side lives on.
HANG_AFTER_STEPS_ENV = "SCHEDTOP_TEST_HANG_AFTER_STEPS"


@dataclass(frozen=True, slots=True)
class Submission:
    """A request for the engine thread, built by the HTTP side."""

    request_id: str  # unique across the server's life
    prompt_ids: list[int]  # the prompt, tokenized off the engine thread (EngineLoop.tokenize)
    params: SamplingParams  # max_tokens None-free: the HTTP side resolved defaults...
    max_tokens: int | None  # ...except this: None = up to max_model_len
    stops: tuple[str, ...]  # stop strings (cut from the text, never streamed)
    include_stop: bool  # vLLM's include_stop_str_in_output: the text keeps the stop string
    skip_special_tokens: bool  # special tokens left out of the text (vLLM's default)
    priority: int  # lower runs first under the priority policy
    arrival_time: float  # engine clock when the HTTP request arrived
    out: asyncio.Queue[Update]  # where this request's updates go (shared by n choices)
    index: int = 0  # which choice of its HTTP request it is (n > 1: parallel sampling)
    tenant: str | None = None  # the client's `user` (recorded: `--group-by tenant`)


@dataclass(frozen=True, slots=True)
class Update:
    """What the engine thread tells one request's HTTP handler."""

    text: str = ""  # new text that may be sent
    num_tokens: int = 0  # output tokens generated so far
    prompt_tokens: int = 0  # prompt length
    finish_reason: str | None = None  # set on the last update
    error: str | None = None  # refused: the message (no other update follows)
    status: int = 200  # refused: the HTTP status to answer with
    scheduled_at: float | None = None  # engine clock of its first scheduling, once known
    arrived: bool = False  # refused: it reached the scheduler (the trace has its arrival)
    index: int = 0  # the choice it is about (Submission.index)
    logprobs: tuple[TokenLogprobs, ...] = ()  # of the tokens new since the last update


ACCEPTED = Update()


@dataclass(slots=True)
class _Live:
    """The engine thread's state of one request."""

    sub: Submission
    detok: IncrementalDetokenizer
    stops: StopStrings
    num_tokens: int = 0
    num_logprobs: int = 0
    scheduled_at: float | None = None
    sent_schedule: bool = False


@dataclass(frozen=True, slots=True)
class _Group:
    """The n choices of one HTTP request: added in one go, so that they are scheduled in
    the same step and the later ones hit the prompt blocks the first one hashed."""

    subs: tuple[Submission, ...]


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Client:
    report: Client


@dataclass(frozen=True, slots=True)
class _AbortAll:
    message: str  # what every request still running is told
    status: int  # ...with this HTTP status


_STOP = object()


class EngineDeadError(SystemExit):
    """The engine thread ended with an error: the server cannot answer any more, so the
    process exits non-zero with the reason on stderr and a supervisor restarts it (vLLM's
    EngineDeadError). A SystemExit, so that it passes the command's error handling
    untouched while `finally` blocks (the recording's close) still run."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"schedtop serve: error: the engine died: {reason}")
        self.reason = reason


@dataclass
class LoopStats:
    """Counters the tests and the benchmark read (engine thread writes, others read)."""

    steps: int = 0  # engine steps run
    added: int = 0  # requests that reached the engine
    refused: int = 0  # requests answered with a 4xx/5xx by the engine thread
    aborted: int = 0  # requests aborted because their client went away
    idle_free_blocks: int = -1  # free KV blocks the last time the engine was idle
    live: int = 0  # requests in flight now
    errors: list[str] = field(default_factory=list)  # the engine's fatal error, if any
    request_faults: int = 0  # per-request exceptions caught (the request failed, not the loop)


class EngineLoop:
    """Runs `engine` on a dedicated thread; the HTTP side talks to it through queues."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting: int,
        metrics: ServeMetrics | None = None,
        on_idle: Callable[[], None] | None = None,
        idle_interval_s: float = IDLE_INTERVAL_S,
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting}: must be >= 0 (0 = no bound)")
        self.engine = engine
        self.clock = engine.clock
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.on_idle = on_idle
        self.idle_interval_s = idle_interval_s
        self.stats = LoopStats()
        # /metrics' latencies: the one fold (engine.metrics), on the engine's clock, which
        # stamps arrivals, so that they are what `stats` reads from the trace
        self._fold = LiveMetrics()
        self.on_dead: Callable[[str], None] | None = None  # called from the engine thread
        self.dead_reason: str | None = None  # why the engine thread ended, if it failed
        # Set once a shutdown begins (asyncio side): new requests get a 503 from then on.
        self.draining = False
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[asyncio.Queue[Update], Update]] = []
        self._tokenizers = ThreadPoolExecutor(TOKENIZER_THREADS, "schedtop-tokenize")
        self._hang_after = int(os.environ.get(HANG_AFTER_STEPS_ENV) or 0)
        self._step_s = 0.0  # running mean of a step's wall time (0: none yet)

    # -- the asyncio side ------------------------------------------------------------------

    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        self._aloop = aloop
        self._thread = threading.Thread(target=self._run, name="schedtop-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, run the engine thread out and wait for it."""
        self._tokenizers.shutdown(wait=False, cancel_futures=True)
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, computed in a worker thread, not the engine's: a long
        prompt or chat template must not stall every running stream (the tokenizer and
        the template are safe to use from several threads). Raises RequestError for a
        prompt the model refuses or the tokenizer cannot take (a lone surrogate, ...)."""
        try:
            return await self.offload(self.engine.tokenize, prompt)
        except RequestError:
            raise
        except Exception as e:  # the tokenizer choked on the text: the client's input
            log.info("prompt refused: the tokenizer raised %s: %s", type(e).__name__, e)
            raise RequestError(f"the prompt cannot be tokenized: {type(e).__name__}: {e}") from e

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the tokenizer pool: tokenizer work never runs on the engine
        thread or the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizers, fn, *args)

    def submit(self, sub: Submission) -> None:
        self._inbox.put(sub)

    def submit_all(self, subs: list[Submission]) -> None:
        """Several requests (the choices of one HTTP request), applied together."""
        self._inbox.put(subs[0] if len(subs) == 1 else _Group(tuple(subs)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def client_report(self, report: Client) -> None:
        self._inbox.put(_Client(report))

    def abort_all(self, message: str, status: int = 503) -> None:
        """Abort every request the engine holds, through the engine (the trace records
        the aborts), each answered with `message` as an error: a stream ends with an error
        event and [DONE], a whole response with that status."""
        self._inbox.put(_AbortAll(message, status))

    @property
    def idle(self) -> bool:
        """No request in the engine and none on its way to it (as last seen by the
        engine thread; good enough to end a drain, which polls)."""
        return self.stats.live == 0 and self._inbox.empty()

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self._has_work()):
                    break
                self._flush()
                if self._has_work():
                    self._step()
                self._flush()
        except Exception as e:  # the engine itself failed: fail every request, then die
            log.exception("the engine loop failed")
            self.dead_reason = f"{type(e).__name__}: {e}"
            self.stats.errors.append(self.dead_reason)
        finally:
            self._shutdown()
        if self.dead_reason is not None and self.on_dead is not None:
            self.on_dead(self.dead_reason)

    def _drain(self, block: bool) -> bool:
        """Apply the queued commands; when idle, wait for one (calling on_idle meanwhile),
        then for others arriving with it (COALESCE_STEP_FRACTION). False once asked to stop."""
        burst_end: float | None = None  # woken from idle: collect arrivals until then
        while True:
            try:
                if block:
                    cmd = self._inbox.get(timeout=self.idle_interval_s)
                elif burst_end is not None:
                    left = burst_end - time.perf_counter()
                    if left <= 0 or self._batch_full():
                        return True
                    cmd = self._inbox.get(timeout=left)
                else:
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                if not block:
                    return True
                self._idle()
                continue
            if cmd is _STOP:
                return False
            self._apply(cmd)
            if block and self._has_work():
                block = False
                wait = min(self._step_s * COALESCE_STEP_FRACTION, COALESCE_MAX_S)
                if wait > 0:
                    burst_end = time.perf_counter() + wait
            self._flush()

    def _batch_full(self) -> bool:
        state = self.engine.stats()
        return state.num_running + state.num_waiting >= self.engine.config.max_num_seqs

    def _has_work(self) -> bool:
        """Requests to run, or an abort with nothing left to run: that still gets its
        step, whose record is where the trace shows the abort and the blocks freed."""
        return self.engine.has_work()

    def _idle(self) -> None:
        state = self.engine.stats()
        self.stats.idle_free_blocks = state.num_free_blocks
        if self.metrics is not None:
            self._guarded("metrics", self.metrics.observe_state, state)
        if self.on_idle is not None:
            self._guarded("the recording's on_idle", self.on_idle)

    def _guarded(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """Run a side task (metrics, the recording's hooks): its failure is logged, and
        neither the engine nor any request fails for it."""
        try:
            fn(*args)
        except Exception:
            log.exception("%s failed; serving goes on", what)
            self.stats.request_faults += 1

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, Submission | _Group):
            for sub in cmd.subs if isinstance(cmd, _Group) else (cmd,):
                try:
                    self._add(sub)
                except Exception as e:  # this request's fault, not the engine's
                    self._fail(sub.request_id, sub.out, e, "adding the request", sub.index)
        elif isinstance(cmd, _Abort):
            self._abort(cmd.request_id)
        elif isinstance(cmd, _Client):
            self._guarded("recording a client report", self.engine.report_client, cmd.report)
        elif isinstance(cmd, _AbortAll):
            for rid, live in list(self._live.items()):
                self._abort(rid)
                update = Update(
                    num_tokens=live.num_tokens,
                    error=cmd.message,
                    status=cmd.status,
                    index=live.sub.index,
                )
                self._send(live.sub.out, update)

    def _fail(
        self,
        request_id: str,
        out: asyncio.Queue[Update],
        e: Exception,
        stage: str,
        index: int = 0,
    ) -> None:
        """An exception while handling one request: that request ends with an error (400
        for input the engine refused, else 500) and is taken out of the engine; the loop
        and every other request go on. The engine's own state is not in doubt: every
        stage that can fail here runs before or after the engine's step, not inside it."""
        log.exception("request %s failed while %s", request_id, stage)
        self.stats.request_faults += 1
        live = self._live.pop(request_id, None)
        try:
            self.engine.output(request_id)
            arrived = True  # the trace has its arrival: keep its id in the client record
        except KeyError:
            arrived = False
        with contextlib.suppress(Exception):  # it may never have reached the engine
            self.engine.abort(request_id)
        with contextlib.suppress(Exception):
            self.engine.forget(request_id)
        status = 400 if isinstance(e, ValueError | TypeError | UnicodeError) else 500
        what = "bad input" if status == 400 else "an internal error"
        message = f"the request failed while {stage} ({what}): {type(e).__name__}: {e}"
        num_tokens = live.num_tokens if live is not None else 0
        update = Update(
            error=message, status=status, num_tokens=num_tokens, arrived=arrived, index=index
        )
        self._send(out, update)

    def _add(self, sub: Submission) -> None:
        problem, status, ids = self._check(sub)
        if problem:
            self.stats.refused += 1
            self._send(sub.out, Update(error=problem, status=status, index=sub.index))
            return
        params = sub.params
        if sub.max_tokens is None:
            params = replace(params, max_tokens=self.engine.config.max_model_len - len(ids))
        engine = self.engine
        engine.add_request(
            sub.request_id,
            ids,
            params,
            arrival_time=sub.arrival_time,
            priority=sub.priority,
            tenant=sub.tenant,
        )
        out = engine.output(sub.request_id)
        if out.finished:  # refused by the scheduler (KV pool too small, ...)
            engine.forget(sub.request_id)
            self.stats.refused += 1
            update = Update(error=out.finish_message, status=400, arrived=True, index=sub.index)
            self._send(sub.out, update)
            return
        self.stats.added += 1
        decode = engine.tokenizer.decode
        if not sub.skip_special_tokens:
            decode = functools.partial(decode, skip_special_tokens=False)
        self._live[sub.request_id] = _Live(
            sub, IncrementalDetokenizer(decode), StopStrings(sub.stops, sub.include_stop)
        )
        self._send(sub.out, Update(prompt_tokens=len(ids), index=sub.index))

    def _check(self, sub: Submission) -> tuple[str, int, list[int]]:
        """(problem, HTTP status, prompt ids): what makes the engine refuse a request."""
        waiting = self.engine.stats().num_waiting
        if self.max_waiting and waiting >= self.max_waiting:
            return (
                f"the server is overloaded: {waiting} requests are waiting "
                f"(--max-waiting {self.max_waiting}); retry later",
                503,
                [],
            )
        if sub.priority != 0 and self.engine.config.policy != "priority":
            return (
                f"priority={sub.priority}: priorities need --scheduling-policy priority",
                400,
                [],
            )
        ids = sub.prompt_ids
        limit = self.engine.config.max_model_len
        if not ids:
            return "the prompt is empty", 400, ids
        if len(ids) >= limit:
            return (
                f"the prompt is {len(ids)} tokens long; this model's maximum context "
                f"length is {limit} tokens",
                400,
                ids,
            )
        if sub.max_tokens is not None and len(ids) + sub.max_tokens > limit:
            return (
                f"this model's maximum context length is {limit} tokens; this request asks "
                f"for {len(ids) + sub.max_tokens} ({len(ids)} in the prompt, "
                f"{sub.max_tokens} max_tokens)",
                400,
                ids,
            )
        return "", 200, ids

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return  # finished meanwhile
        self.engine.abort(request_id)
        self.stats.aborted += 1
        if self.metrics is not None:
            self._guarded("metrics", self.metrics.observe_finish, "abort")
        self.engine.forget(request_id)

    def _step(self) -> None:
        engine = self.engine
        t0 = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - t0
        w = STEP_TIME_WEIGHT if self._step_s else 1.0
        self._step_s += w * (took - self._step_s)
        self.stats.steps += 1
        last = engine.last_step
        if last is not None:
            step = last.stats()
            # Admissions happen at the step's start (vLLM's scheduled_ts): the engine's
            # reading when its work began, as the trace's step has it (time - work).
            started = engine.core.last_end - last.report.work_ns / 1e9
            for a in step.admitted:
                live = self._live.get(a.request_id)
                if live is not None and live.scheduled_at is None:
                    live.scheduled_at = started
            if self.metrics is not None:
                self._guarded("metrics", self._observe, last.report, step)
        for out in outs:
            live = self._live.get(out.request_id)
            if live is not None:
                try:
                    self._advance(live, out)
                except Exception as e:  # detokenizing, stop strings: this request's fault
                    self._fail(
                        out.request_id, live.sub.out, e, "producing its text", live.sub.index
                    )
        if self._hang_after and self.stats.steps >= self._hang_after:
            self._hang(last.report.step if last is not None else -1)

    def _observe(self, report: Step, step: StepStats) -> None:
        """The step into the metrics' fold, what it added into /metrics. The step ended
        when the engine read its clock after the update (EngineCore.last_end): the instant
        the trace's recorder writes as the step's time, so /metrics and `stats` agree;
        not `started` plus the work, which was late by however long the engine thread
        waited for the interpreter between this loop's clock read and the engine's."""
        assert self.metrics is not None
        obs = self._fold.step(report, self.engine.core.last_end)
        self.metrics.observe_step(obs, self.engine.stats(), step.num_scheduled_tokens)

    def _hang(self, step: int) -> None:
        """The hang test hook: no step, no idle call, no flush from here on."""
        print(f"{HANG_AFTER_STEPS_ENV}: the engine thread hangs after step {step}", file=sys.stderr)
        sys.stderr.flush()
        while True:
            time.sleep(3600)

    def _advance(self, live: _Live, out: RequestOutput) -> None:
        new = out.output_token_ids[live.num_tokens :]
        live.num_tokens = len(out.output_token_ids)
        text = live.stops.feed(live.detok.push(new)) if new else ""
        reason = out.finish_reason
        if live.stops.matched is not None:
            reason = "stop"
            if not out.finished:  # vLLM ends a stop-string match with an abort, too
                self.engine.abort(out.request_id)
        elif out.finished:
            text += live.stops.feed(live.detok.finish(), final=True)
        logprobs: tuple[TokenLogprobs, ...] = ()
        if out.logprobs is not None and len(out.logprobs) > live.num_logprobs:
            logprobs = tuple(out.logprobs[live.num_logprobs :])
            live.num_logprobs = len(out.logprobs)
        update = Update(
            text=text,
            num_tokens=live.num_tokens,
            prompt_tokens=len(out.prompt_token_ids),
            finish_reason=reason,
            scheduled_at=None if live.sent_schedule else live.scheduled_at,
            index=live.sub.index,
            logprobs=logprobs,
        )
        live.sent_schedule = live.sent_schedule or live.scheduled_at is not None
        if reason is not None:
            del self._live[out.request_id]
            if self.metrics is not None:
                self._guarded("metrics", self.metrics.observe_finish, reason)
            self.engine.forget(out.request_id)
        if text or logprobs or reason is not None or update.scheduled_at is not None:
            self._send(live.sub.out, update)

    # -- delivery ----------------------------------------------------------------------------

    def _send(self, q: asyncio.Queue[Update], update: Update) -> None:
        self._outbox.append((q, update))

    def _flush(self) -> None:
        """Hand this round's updates to the event loop in one call: one wake-up per step,
        not one per request."""
        self.stats.live = len(self._live)
        if not self._outbox or self._aloop is None:
            return
        batch, self._outbox = self._outbox, []
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._aloop.call_soon_threadsafe(_deliver, batch)

    def _shutdown(self) -> None:
        """Answer whatever is still queued, abort what runs, record the last step."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            for sub in cmd.subs if isinstance(cmd, _Group) else (cmd,):
                if isinstance(sub, Submission):
                    update = Update(
                        error="the server is shutting down", status=503, index=sub.index
                    )
                    self._send(sub.out, update)
        for rid, live in list(self._live.items()):
            with contextlib.suppress(Exception):  # the engine may be what failed
                self.engine.abort(rid)
            index = live.sub.index
            if self.dead_reason is not None:  # vLLM answers EngineDeadError with a 500
                message = f"the engine died: {self.dead_reason}"
                update = Update(num_tokens=live.num_tokens, error=message, status=500, index=index)
            else:
                update = Update(num_tokens=live.num_tokens, finish_reason="abort", index=index)
            self._send(live.sub.out, update)
        self._live.clear()
        self._flush()
        if not self.stats.errors and self.engine.has_work():
            with contextlib.suppress(Exception):  # the last aborts' step, for the trace
                self.engine.step()


def _deliver(batch: list[tuple[asyncio.Queue[Update], Update]]) -> None:
    for q, update in batch:
        q.put_nowait(update)
