"""LLMEngine: the real serving engine. Prompts in (text, chat messages or token ids),
tokens and text out, with the scheduler deciding every step and the model runner
executing it. `generate()` is the offline entry point, like vLLM's `LLM.generate`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.config import EngineConfig, RunnerOptions
from engine.core import EngineCore, StepResult
from engine.events import NULL_SINK, EventSink, report_client
from engine.kv.hashing import BlockHasher
from engine.model.errors import RequestError
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ModelRunner, build_runner
from engine.model.tokenizer import ModelTokenizer
from engine.outputs import TokenLogprobs
from engine.records import Client
from engine.request import Request, SamplingParams
from engine.stats import EngineStats

Messages = list[dict[str, str]]
Prompt = str | Sequence[int] | Messages
STALL_STEPS = 1000  # steps without any progress before generate() gives up


@dataclass
class RequestOutput:
    """A request's state as the caller sees it: cumulative tokens and text."""

    request_id: str  # the caller's id
    prompt_token_ids: list[int]  # the prompt, tokenized
    output_token_ids: list[int]  # sampled so far
    text: str  # output_token_ids decoded, special tokens skipped
    finished: bool  # no more tokens will come
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    finish_message: str = ""  # what was wrong, for "error"
    num_preemptions: int = 0  # times preempted (recompute)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0  # engine clock
    first_token_time: float | None = None  # engine clock at the first output token
    finish_time: float | None = None  # engine clock when it finished
    token_times: list[float] = field(default_factory=list, repr=False)  # per output token
    # per output token, when the request asked for logprobs (SamplingParams.logprobs)
    logprobs: list[TokenLogprobs] | None = field(default=None, repr=False)

    # No TTFT or TPOT here: those are the run's fold's (engine.metrics), on the step's
    # clock, the numbers `run`, `stats` and /metrics give; these times are when the caller
    # got the tokens, after the step (its detokenization included).


class LLMEngine:
    """Tokenizer, scheduler and model runner behind add_request / step / abort."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig | None = None,
        options: RunnerOptions | None = None,
        sink: EventSink = NULL_SINK,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.tokenizer: ModelTokenizer = model.tokenizer
        self.options = options or RunnerOptions()
        self.runner: ModelRunner
        self.runner, self.config = build_runner(model, config or EngineConfig(), self.options)
        self.clock = clock
        self.core = EngineCore(self.config, self.runner, sink, clock)
        self.core.arrival_clock = clock  # add_request stamps arrivals with it
        self._hasher = BlockHasher(self.config.block_size)
        self._outputs: dict[str, RequestOutput] = {}
        self._live: dict[str, Request] = {}  # queued or running
        self._ids = itertools.count()
        self.last_step: StepResult | None = None  # the latest step's report, for callers

    @classmethod
    def from_model(
        cls,
        model: str | Path | None = None,
        config: EngineConfig | None = None,
        options: RunnerOptions | None = None,
        sink: EventSink = NULL_SINK,
    ) -> LLMEngine:
        """Load `model` (None: the default SmolLM2) and build an engine for it."""
        loaded = load_model(model)
        engine = cls(loaded, config, options, sink)
        loaded.weights.clear()  # the model holds its own (fused, on-device) copies
        return engine

    # -- requests --------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: text, chat messages (through the chat template) or ids."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return self.tokenizer.apply_chat_template(prompt)
        ids = list(prompt)
        vocab = self.model.spec.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RequestError(
                    f"prompt token {t!r} is not a token id of this model (0..{vocab - 1})"
                )
        return ids

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str | None = None,
    ) -> str:
        """Queue a request. A prompt that can never run (empty, too long for max_model_len
        or for the KV pool) finishes at once with finish_reason "error" (see `output()`);
        malformed input raises RequestError and queues nothing."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._outputs:
            raise RequestError(f"duplicate request id {rid!r}")
        params = self._with_model_stops(params or SamplingParams())
        vocab = self.model.spec.vocab_size
        for t, _ in params.logit_bias:
            if t >= vocab:
                raise RequestError(
                    f"logit_bias: {t} is not a token id of this model (0..{vocab - 1})"
                )
        ids = self.tokenize(prompt)
        arrival = self.clock() if arrival_time is None else arrival_time
        request = Request(
            rid,
            ids,
            params,
            arrival_time=arrival,
            priority=priority,
            eos_token_id=self.tokenizer.eos_token_id,
            block_hasher=self._hasher,
            tenant=tenant,
        )
        self._outputs[rid] = RequestOutput(rid, ids, [], "", False, None, arrival_time=arrival)
        self.core.add_request(request)
        if request.is_finished:  # refused by the scheduler: its output is final already
            self.core.finished.pop(rid, None)
            self._update(request, self.clock())
        else:
            self._live[rid] = request
        return rid

    def _with_model_stops(self, params: SamplingParams) -> SamplingParams:
        """A model with several end tokens stops on all of them (unless ignore_eos)."""
        extra = self.tokenizer.extra_eos_token_ids
        if not extra or params.ignore_eos:
            return params
        return replace(
            params, stop_token_ids=tuple(dict.fromkeys((*params.stop_token_ids, *extra)))
        )

    def abort(self, request_id: str) -> bool:
        """Finish a queued or running request with finish_reason "abort"."""
        if not self.core.abort(request_id):
            return False
        self.runner.drop(request_id)
        self._live.pop(request_id, None)
        self._update(self.core.finished.pop(request_id), self.clock())
        return True

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def has_work(self) -> bool:
        """Whether a step now would do something: run requests, or report arrivals and
        aborts (with the blocks they freed) that happened since the last step."""
        return self.core.has_work()

    def stats(self) -> EngineStats:
        """The engine's load now: queue lengths and KV blocks (engine.stats)."""
        return self.core.stats()

    def report_client(self, report: Client) -> None:
        """Hand what a server saw of one HTTP request to the engine's sink (the recorder
        writes it as a CLIENT record); from the engine's thread, between two steps."""
        report_client(self.core.sink, report)

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns the requests that got a token or finished (including
        those that finished without running: refused prompts and aborts)."""
        result = self.core.step()
        now = self.clock()
        self.last_step = result
        touched: dict[str, Request] = {r.request_id: r for r in result.updated}
        for r in self.core.take_finished():  # every finish, however it came about
            touched[r.request_id] = r
            self.runner.drop(r.request_id)
            self._live.pop(r.request_id, None)
        return [_snapshot(self._update(r, now)) for r in touched.values()]

    def _update(self, req: Request, now: float) -> RequestOutput:
        out = self._outputs[req.request_id]
        new = len(req.output_token_ids) - len(out.output_token_ids)
        if new > 0:
            if out.first_token_time is None:
                out.first_token_time = now
            out.token_times.extend([now] * new)
            out.output_token_ids = list(req.output_token_ids)
            out.text = self.tokenizer.decode(out.output_token_ids)
            if req.logprobs is not None:
                out.logprobs = list(req.logprobs)
        out.num_preemptions = req.num_preemptions
        out.num_cached_tokens = max(req.num_cached_tokens, 0)
        if req.is_finished and not out.finished:
            out.finished = True
            out.finish_reason = req.finish_reason
            out.finish_message = req.finish_message
            out.finish_time = now
        return out

    def forget(self, request_id: str) -> None:
        """Drop a finished request's output (a server that runs for days must not keep
        every request it ever served). Its id may then be used again."""
        out = self._outputs.get(request_id)
        if out is not None and out.finished:
            del self._outputs[request_id]

    def output(self, request_id: str) -> RequestOutput:
        """The request's state now (a copy: later steps do not change it)."""
        return _snapshot(self._outputs[request_id])

    # -- offline ---------------------------------------------------------------------------

    def stream(
        self,
        prompts: Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Add every prompt, then step until all finish, yielding each update."""
        yield from self._run_until_finished(self._add_all(prompts, params))

    def _run_until_finished(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = {i for i in ids if not self._outputs[i].finished}
        idle = 0
        while pending:
            outs = self.step() if self.core.has_unfinished() else []
            idle = 0 if outs else idle + 1
            if idle > STALL_STEPS:
                raise RuntimeError(
                    f"no progress in {STALL_STEPS} steps with {len(pending)} requests unfinished"
                )
            for out in outs:
                if out.request_id in pending:
                    yield out
            # Aborted between two yields: finished without a step reporting it.
            pending = {i for i in pending if not self._outputs[i].finished}

    def generate(
        self,
        prompts: Iterable[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of `prompts`."""
        ids = self._add_all(prompts, params)
        for _ in self._run_until_finished(ids):
            pass
        return [_snapshot(self._outputs[i]) for i in ids]

    def _add_all(
        self, prompts: Iterable[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[str]:
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise RequestError(f"{len(per)} sampling params for {len(prompts)} prompts")
        return [self.add_request(None, p, sp) for p, sp in zip(prompts, per)]

    def close(self) -> None:
        self.core.close()


def _snapshot(out: RequestOutput) -> RequestOutput:
    return replace(
        out,
        output_token_ids=list(out.output_token_ids),
        token_times=list(out.token_times),
        logprobs=None if out.logprobs is None else list(out.logprobs),
    )
