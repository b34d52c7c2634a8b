"""The HTTP routes: OpenAI's completions and chat completions (streaming or not), models,
health, version, Prometheus metrics, and schedtop's own live stream and incident cut.

A handler validates the request, hands it to the engine thread and relays what comes
back. A client that goes away (a closed stream, a cancelled request) aborts its request.
Every response that ends, good or bad, is reported to the engine's sink as a
Client record, so that the trace holds what only the server sees."""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from engine.model.errors import RequestError
from engine.outputs import TokenLogprobs
from engine.records import Client, ns
from recorder.errors import RecordingError
from recorder.serving import IncidentError, ServerRecording
from recorder.stream import StreamSubscription
from schedtop_server.loop import EngineLoop, Submission, Update
from schedtop_server.metrics import CONTENT_TYPE, ServeMetrics
from schedtop_server.protocol import (
    MAX_CLIENT_ID,
    NEUTRAL_CHAT,
    NEUTRAL_COMPLETION,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    Shapes,
    TokenizeRequest,
    error_body,
    media_problem,
    refusal,
    take_neutral,
)

log = logging.getLogger("schedtop.serve")
M = TypeVar("M", bound=BaseModel)

STREAM_POLL_S = 0.5  # a live viewer's get() timeout: how soon a disconnect is noticed
# A request body larger than this is refused (413) before it is read whole: a prompt of
# 8 MiB is already ~2M tokens, far past any context, and reading and parsing 20 MB cost
# seconds and gigabytes (issue 26 item 3).
DEFAULT_MAX_BODY_BYTES = 8 << 20
# A request's headers, and then its body, must arrive within this long: a client that
# trickles them (slowloris) otherwise holds a connection and its buffers for as long as it
# likes. uvicorn's keep-alive timeout only covers the idle time between two requests.
DEFAULT_READ_TIMEOUT_S = 30.0
TENANT_CHARS = 256  # of a client's `user`, recorded as its request's tenant
RETRY_AFTER_S = 1  # a 503's Retry-After: the queue or a restart is seconds away, not minutes
UNAUTHENTICATED_RECORD_S = 10.0  # 401s are counted, and recorded at most this often


@dataclass(frozen=True)
class ServeSettings:
    """What the routes need to know besides the engine."""

    model_name: str  # the served model's name (/v1/models, the `model` field)
    max_model_len: int  # reported by /v1/models
    api_key: str | None = None  # required as a Bearer token on /v1/* when set
    version: str = "dev"  # /version
    incident_window_s: float = 600.0  # POST /v1/schedtop/incident's default window
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # headers, then the body, within this

    def __post_init__(self) -> None:
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise ValueError(f"read_timeout_s={self.read_timeout_s}: must be a number > 0")
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key: must not be empty (leave it unset for no auth)")
        if self.incident_window_s <= 0:
            raise ValueError(f"incident_window_s={self.incident_window_s}: must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes}: must be >= 1024")


class Refused(Exception):
    """A request answered with an error status before it reached the engine."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class _Choice:
    """What one choice's client saw (engine clock): with n > 1 each choice is its own
    engine request, and its record in the trace has its own timings."""

    request_id: str = ""  # its engine request
    completion_tokens: int = 0
    scheduled_at: float | None = None
    first_sent: float | None = None
    last_sent: float | None = None
    ended: float | None = None  # its last chunk went out (None: the response's end)
    gaps: list[float] = field(default_factory=list)
    finish_reason: str = ""

    def sent(self, now: float) -> None:
        if self.first_sent is None:
            self.first_sent = now
        elif self.last_sent is not None:
            self.gaps.append(now - self.last_sent)
        self.last_sent = now


@dataclass
class _Exchange:
    """One HTTP request's timings as the server sees them (engine clock)."""

    loop: EngineLoop
    endpoint: str
    stream: bool
    received: float
    request_id: str = ""
    prompt_tokens: int = 0
    status: int = 200  # what the response ends as (an error after acceptance changes it)
    message: str = ""  # the error, if any
    on_report: Callable[[str], None] | None = None  # called with the request id once ended
    # One per choice (n); with n > 1 each is recorded as its own request, under this
    # exchange's id as their parent (what vLLM's per-request metrics count: each child).
    choices: list[_Choice] = field(default_factory=lambda: [_Choice()])

    def split(self, children: list[str]) -> None:
        """n > 1: `children` are the choices' engine requests."""
        self.choices = [_Choice(rid) for rid in children]

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def absorb(self, u: Update) -> None:
        c = self.choices[u.index] if u.index < len(self.choices) else self.choices[0]
        if u.scheduled_at is not None and c.scheduled_at is None:
            c.scheduled_at = u.scheduled_at
        c.completion_tokens = max(c.completion_tokens, u.num_tokens)
        if u.finish_reason is not None:
            c.finish_reason = u.finish_reason

    def sent(self, index: int | None = None) -> None:
        """A token chunk of choice `index` went out (None: of every choice, at once)."""
        now = self.loop.clock()
        for c in self.choices if index is None else (self.choices[index],):
            c.sent(now)
            if c.finish_reason:
                c.ended = now

    def abandon(self) -> None:
        """The client went away: every choice not finished ends as aborted."""
        for c in self.choices:
            if not c.finish_reason or c.ended is None:
                c.finish_reason = "abort"

    def report(self, status: int, message: str = "") -> None:
        if self.on_report is not None:
            self.on_report(self.request_id)
        r = self.received
        now = self.loop.clock()
        split = len(self.choices) > 1 and bool(self.request_id)
        for c in self.choices:
            # a choice of n ends with its last chunk; a lone one with the response
            end = c.ended if split and c.ended is not None else now
            self.loop.client_report(
                Client(
                    after_step=-1,  # the recorder places it
                    time_ns=0,
                    request_id=c.request_id if split else self.request_id,
                    endpoint=self.endpoint,
                    status=status,
                    finish_reason=c.finish_reason,
                    stream=self.stream,
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=c.completion_tokens,
                    queue_ns=None if c.scheduled_at is None else ns(c.scheduled_at - r),
                    ttft_ns=None if c.first_sent is None else ns(c.first_sent - r),
                    e2e_ns=ns(end - r),
                    itl_ns=tuple(map(ns, c.gaps)),
                    message=message,
                    parent_id=self.request_id if split else "",
                )
            )
            if not split:
                return  # refused before the engine: one record for the response


def build_app(
    loop: EngineLoop,
    settings: ServeSettings,
    metrics: ServeMetrics,
    recording: ServerRecording | None = None,
) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="schedtop serve", version=settings.version, lifespan=lifespan)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> Response:
        # A bug in a handler: still an OpenAI-shaped answer (not Starlette's plain text),
        # and recorded, so that the trace's HTTP statistics count it.
        log.exception("%s failed", request.url.path)
        return _refuse(loop, request.url.path, 500, f"internal error: {type(e).__name__}: {e}")

    if settings.api_key is not None:
        app.add_middleware(_Auth, key=settings.api_key, loop=loop, metrics=metrics)
    # Added last, so outermost: a body too large or too slow is refused before anything
    # reads it.
    app.add_middleware(
        _BodyLimit, limit=settings.max_body_bytes, loop=loop, timeout_s=settings.read_timeout_s
    )

    @app.get("/health")
    async def health() -> Response:
        # vLLM answers 200 with no body; the body here adds what a probe may want to log.
        # A stopped recording does not fail the probe: serving goes on without it.
        engine = "draining" if loop.draining else "running" if loop.alive else "dead"
        state: dict[str, Any] = {"engine": engine, "recording": _recording_state(recording)}
        if loop.dead_reason is not None:
            state["reason"] = loop.dead_reason
        ok = loop.alive and not loop.draining
        headers = None if ok else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse(state, status_code=200 if ok else 503, headers=headers)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": settings.version}

    @app.get("/metrics")
    async def prometheus() -> Response:
        if recording is not None:
            metrics.observe_recording(recording.stopped is None, recording.rotations_failed)
        metrics.draining.set(1 if loop.draining else 0)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "schedtop",
                    "max_model_len": settings.max_model_len,
                }
            ],
        }

    ids = _Ids()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, loop, settings, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, loop, settings, ids, chat=True)

    # vLLM's /tokenize and /detokenize, outside /v1 and so without the key, as vLLM has
    # them: `vllm bench serve` calls them without one to check its tokenizer is ours.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await _tokenize(request, loop, settings)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await _detokenize(request, loop, settings)

    @app.post("/v1/schedtop/incident")
    async def incident(request: Request) -> Response:
        return await _incident(request, loop, settings, recording)

    @app.get("/v1/schedtop/stream")
    async def stream() -> Response:
        if recording is None:
            return _unsupported(loop, "/v1/schedtop/stream")
        try:
            sub = await asyncio.to_thread(recording.subscribe)
        except RuntimeError as e:  # the most viewers the recording serves are attached
            return _refuse(loop, "/v1/schedtop/stream", 503, str(e))
        return StreamingResponse(_trace_bytes(sub), media_type="application/octet-stream")

    return app


class _Auth:
    """Every /v1/* route needs `Authorization: Bearer KEY`; /health, /version and
    /metrics stay open (probes and Prometheus scrapers carry no key). Plain ASGI, so that
    streamed responses and disconnects pass through untouched."""

    def __init__(self, app: Any, key: str, loop: EngineLoop, metrics: ServeMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.loop = loop
        self.metrics = metrics
        self.unrecorded = 0  # 401s since the last one recorded
        self.recorded_at: float | None = None  # engine clock of that record

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key: send 'Authorization: Bearer KEY'"
                self._count()
                await _error(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _count(self) -> None:
        """Anyone can send 401s, as fast as they like: each is counted (/metrics), and
        the trace gets one record per UNAUTHENTICATED_RECORD_S saying how many, with no
        byte the client chose (its path is not kept), so that they cannot fill the disk."""
        self.metrics.unauthenticated.inc()
        self.unrecorded += 1
        now = self.loop.clock()
        if self.recorded_at is not None and now - self.recorded_at < UNAUTHENTICATED_RECORD_S:
            return
        n, self.unrecorded, self.recorded_at = self.unrecorded, 0, now
        message = f"{n} request(s) without a valid API key since the last such record"
        _report_refusal(self.loop, "/v1/*", now, 401, message)


class _BodyLimit:
    """Refuses a request body over `limit` bytes with a 413: at once when Content-Length
    says so, else as soon as the bytes received pass it (a chunked upload). The body is
    read here, bounded, and handed on whole: every route reads its body whole anyway."""

    def __init__(self, app: Any, limit: int, loop: EngineLoop, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.loop = loop
        self.timeout_s = timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.limit
        chunks: list[bytes] = []
        size = 0
        more = not too_big
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:  # the whole body within the timeout, however it is trickled
                message = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                message = f"the request body did not arrive within {self.timeout_s:g} s"
                _report_refusal(self.loop, scope["path"], self.loop.clock(), 408, message)
                response = _error(408, message, code="request_timeout")
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before it finished sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                too_big = True
                break
            chunks.append(chunk)
            more = message.get("more_body", False)
        if too_big:
            message = f"the request body is larger than this server's limit of {self.limit} bytes"
            _report_refusal(self.loop, scope["path"], self.loop.clock(), 413, message)
            await _error(413, message, code="request_too_large")(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)


# -- generation ------------------------------------------------------------------------------


class _Ids:
    """The engine request ids in use (asyncio side only). A client may name its request
    (X-Request-Id, or vLLM's `request_id` field), and the trace then shows its name, as
    vLLM's do ("cmpl-" + the client's id); two live requests with one name get a suffix,
    since the engine's ids must be unique while a request lives."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def take(self, prefix: str, client_id: str | None) -> str:
        rid = f"{prefix}-{client_id or uuid.uuid4().hex}"
        if rid in self.live:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.live.add(rid)
        return rid

    def take_child(self, parent: str, index: int) -> str:
        """Choice `index` of a request with n > 1: its own engine request, named after
        the parent with the index as a suffix."""
        rid = f"{parent}-{index}"
        if rid in self.live:
            rid = f"{rid}-{uuid.uuid4().hex[:8]}"
        self.live.add(rid)
        return rid

    def release(self, rid: str) -> None:
        self.live.discard(rid)


def _client_id(request: Request, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The client's name for its request: the X-Request-Id header, else the body's
    request_id (vLLM's order). Printable ASCII and bounded: it goes into the trace."""
    given = request.headers.get("x-request-id")
    if given is None:
        return body.request_id
    if not 0 < len(given) <= MAX_CLIENT_ID or not given.isprintable() or not given.isascii():
        raise Refused(400, f"X-Request-Id must be 1 to {MAX_CLIENT_ID} printable ASCII characters")
    return given


async def _generate(
    request: Request, loop: EngineLoop, settings: ServeSettings, ids: _Ids, chat: bool
) -> Response:
    endpoint = request.url.path
    received = loop.clock()
    try:
        body = _parse(await request.body(), chat, settings)
        client_id = _client_id(request, body)
        _check_bias(body, loop.engine.model.spec.vocab_size)
    except Refused as e:
        _report_refusal(loop, endpoint, received, e.status, e.message)
        return _error(e.status, e.message, e.param)
    if not loop.alive:  # nobody would ever answer: say so rather than hang
        message = "the engine is not running (see the server's log)"
        _report_refusal(loop, endpoint, received, 503, message)
        return _error(503, message)
    if loop.draining:  # shutting down: another replica (or this one restarted) will serve it
        message = "the server is shutting down; retry later"
        _report_refusal(loop, endpoint, received, 503, message)
        return _error(503, message)
    ex = _Exchange(loop, endpoint, body.streaming, received)
    ex.request_id = ids.take("chatcmpl" if chat else "cmpl", client_id)
    n = body.num_choices
    # n > 1: vLLM's parallel sampling, n engine requests of the same prompt, added in one
    # go: the first one's prompt blocks are hashed when it is scheduled, and the others,
    # admitted in the same step, take them as prefix-cache hits (the trace shows them).
    children = [ex.request_id] if n == 1 else [ids.take_child(ex.request_id, i) for i in range(n)]
    everyone = children if n == 1 else [ex.request_id, *children]
    if n > 1:
        ex.split(children)

    def release(_: str) -> None:
        for rid in everyone:
            ids.release(rid)

    ex.on_report = release
    out: asyncio.Queue[Update] = asyncio.Queue()
    prompt: Any = body.chat() if isinstance(body, ChatCompletionRequest) else body.prompt
    try:
        prompt_ids = await loop.tokenize(prompt)
    except RequestError as e:
        release("")
        ex.request_id = ""  # it never reached the engine: the trace has no such request
        ex.report(400, str(e))
        return _error(400, str(e))
    max_tokens = body.output_limit()
    params = body.sampling_params(max_tokens or 1)
    subs = []
    for i, rid in enumerate(children):
        child = params
        if n > 1 and params.seed is not None:
            child = replace(params, seed=(params.seed + i) % (1 << 63))  # as vLLM seeds them
        subs.append(
            Submission(
                request_id=rid,
                prompt_ids=prompt_ids,
                params=child,
                max_tokens=max_tokens,
                stops=body.stop_strings(),
                include_stop=bool(body.include_stop_str_in_output),
                skip_special_tokens=body.skip_special_tokens is not False,
                priority=body.priority or 0,
                arrival_time=received,
                out=out,
                index=i,
                # the trace keeps a bounded name: the field is the client's to fill
                tenant=body.user[:TENANT_CHARS] if body.user else None,
            )
        )
    loop.submit_all(subs)
    firsts = [await out.get() for _ in children]  # each one's acceptance or refusal
    failed = next((u for u in firsts if u.error is not None), None)
    if failed is not None:
        for u in firsts:
            if u.error is None:
                loop.abort(children[u.index])
        rid = ex.request_id
        if not failed.arrived or n > 1:
            ex.request_id = ""  # refused before the scheduler: the trace has no such request
        ex.report(failed.status, failed.error or "")
        release(rid)
        code = "overloaded" if failed.status == 503 else None
        return _error(failed.status, failed.error or "", code=code)
    ex.prompt_tokens = firsts[0].prompt_tokens
    tokenizer = loop.engine.tokenizer
    shapes = Shapes(chat, ex.request_id, settings.model_name, _token_spelling(tokenizer))
    echo = ""
    if isinstance(body, CompletionRequest) and body.echo:
        echo = body.prompt if isinstance(body.prompt, str) else tokenizer.decode(prompt_ids)
    if body.streaming:
        usage = body.usage_options()
        return StreamingResponse(
            _sse(out, ex, shapes, usage, n, echo, children),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": ex.request_id},
        )
    wants = params.logprobs is not None
    return await _whole(request, out, ex, shapes, n, echo, children, wants)


def _check_bias(body: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    for token, _ in body.bias():
        if token >= vocab_size:
            raise Refused(
                400,
                f"logit_bias: {token} is not a token id of this model (0..{vocab_size - 1})",
                "logit_bias",
            )


def _token_spelling(tokenizer: Any) -> Callable[[int], str]:
    """A token's text in logprobs, as vLLM spells it: the token decoded alone, special
    tokens included (a piece of a multi-byte character decodes to U+FFFD)."""

    @functools.lru_cache(maxsize=4096)
    def spell(token_id: int) -> str:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))

    return spell


def _parse(
    raw: bytes, chat: bool, settings: ServeSettings
) -> CompletionRequest | ChatCompletionRequest:
    data = _json_object(raw)
    problem = media_problem(data) if chat else None
    if problem is not None:
        raise Refused(400, problem[0], problem[1])
    neutral = NEUTRAL_CHAT if chat else NEUTRAL_COMPLETION
    value = dict(data)
    key = take_neutral(data, neutral)
    if key is not None:
        raise Refused(400, refusal(key, value[key], neutral), key)
    body: CompletionRequest | ChatCompletionRequest = (
        _validate(ChatCompletionRequest, data, settings)
        if chat
        else _validate(CompletionRequest, data, settings)
    )
    problem = body.problem()
    if problem is not None:
        raise Refused(400, problem[0], problem[1])
    try:
        body.sampling_params(body.output_limit() or 1)  # the limits of every value
    except ValueError as e:
        raise Refused(400, str(e)) from None
    return body


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes: the client's input
        raise Refused(400, "the body is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise Refused(400, "the body must be a JSON object")
    return data


def _validate(model: type[M], data: dict[str, Any], settings: ServeSettings) -> M:
    """`data` as `model`, the first problem a Refused naming its field; a `model` field
    must name the served model (404 otherwise, as OpenAI and vLLM answer)."""
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise Refused(400, f"unknown field {param!r}", param) from None
        raise Refused(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    name = getattr(body, "model", None)
    if name is not None and name != settings.model_name:
        raise Refused(
            404,
            f"the model {name!r} does not exist; this server serves {settings.model_name!r}",
            "model",
        )
    return body


def _sse_line(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _sse(
    out: asyncio.Queue[Update],
    ex: _Exchange,
    shapes: Shapes,
    usage: tuple[bool, bool],
    n: int = 1,
    echo: str = "",
    children: list[str] | None = None,
) -> AsyncIterator[bytes]:
    """The event stream; when the client goes away, Starlette cancels this generator
    while it waits, and the request is aborted. `usage`: (a last chunk with the usage,
    usage on every chunk too), vLLM's include_usage and continuous_usage_stats. With
    n > 1 the choices' chunks interleave, each with its index; `echo`: the prompt's text,
    sent first (completions)."""
    include_usage, continuous = usage
    ids = children or [ex.request_id]
    offsets = [len(echo)] * n  # completions' text_offset: characters so far per choice
    finished = [False] * n
    done = False
    try:
        for i in range(n):
            if shapes.chat:
                now = (ex.prompt_tokens, 0) if continuous else None
                yield _sse_line(shapes.chunk("", None, first=True, usage_now=now, index=i))
            elif echo:
                yield _sse_line(shapes.chunk(echo, None, index=i))
        while not done:
            u = await out.get()
            ex.absorb(u)
            if u.error is not None:  # failed or aborted after it started: say so, then [DONE]
                for i, rid in enumerate(ids):
                    if not finished[i] and i != u.index:
                        ex.loop.abort(rid)
                yield _sse_line(error_body(u.error, u.status))
                ex.status, ex.message = u.status, u.error
                break
            i = u.index
            finished[i] = finished[i] or u.finish_reason is not None
            done = all(finished)
            if u.text or u.logprobs or u.finish_reason is not None:
                now = (ex.prompt_tokens, ex.completion_tokens) if continuous else None
                text = u.text if u.text or not shapes.chat else None
                lp = shapes.logprobs(u.logprobs, offsets[i]) if u.logprobs else None
                offsets[i] += sum(len(shapes.token_str(x.token_id)) for x in u.logprobs)
                yield _sse_line(
                    shapes.chunk(text, u.finish_reason, usage_now=now, index=i, logprobs=lp)
                )
                if u.text:
                    ex.sent(i)
                if u.finish_reason is not None:
                    ex.choices[i].ended = ex.loop.clock()  # its last chunk is out
        if include_usage and done:
            yield _sse_line(shapes.usage_chunk(ex.prompt_tokens, ex.completion_tokens))
        yield b"data: [DONE]\n\n"
    finally:
        if not done and ex.status == 200:
            for i, rid in enumerate(ids):
                if not finished[i]:
                    ex.loop.abort(rid)
            ex.abandon()
        ex.report(ex.status, ex.message)


async def _whole(
    request: Request,
    out: asyncio.Queue[Update],
    ex: _Exchange,
    shapes: Shapes,
    n: int = 1,
    echo: str = "",
    children: list[str] | None = None,
    logprobs: bool = False,
) -> Response:
    """Collect the whole output (every choice); abort if the client disconnects.
    `logprobs`: the request asked for them (each choice gets its list, maybe empty)."""
    ids = children or [ex.request_id]
    parts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[TokenLogprobs]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n

    async def collect() -> None:
        left = n
        while left:
            u = await out.get()
            ex.absorb(u)
            if u.error is not None:
                ex.status, ex.message = u.status, u.error
                for i, rid in enumerate(ids):
                    if reasons[i] is None and i != u.index:
                        ex.loop.abort(rid)
                return
            i = u.index
            parts[i].append(u.text)
            lps[i].extend(u.logprobs)
            if u.finish_reason is not None and reasons[i] is None:
                reasons[i] = u.finish_reason
                left -= 1

    task = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(request))
    await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not task.done():
        task.cancel()
        for i, rid in enumerate(ids):
            if reasons[i] is None:
                ex.loop.abort(rid)
        ex.abandon()
        ex.report(499, "the client closed the connection")
        return Response(status_code=499)
    if ex.status != 200:  # failed in the engine after it was accepted
        ex.report(ex.status, ex.message)
        return _error(ex.status, ex.message)
    ex.sent()
    ex.report(200)
    choices = [
        Choice(
            echo + "".join(parts[i]),
            reasons[i],
            tuple(lps[i]) if logprobs else None,
            len(echo),
        )
        for i in range(n)
    ]
    return JSONResponse(
        shapes.full(choices, ex.prompt_tokens, ex.completion_tokens),
        headers={"X-Request-Id": ex.request_id},
    )


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- vLLM's tokenizer routes -----------------------------------------------------------------


async def _tokenize(request: Request, loop: EngineLoop, settings: ServeSettings) -> Response:
    endpoint = request.url.path
    try:
        body = _validate(TokenizeRequest, _json_object(await request.body()), settings)
        problem = body.problem()
        if problem is not None:
            raise Refused(400, problem[0], problem[1])
        tokenizer = loop.engine.tokenizer
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages).chat()
            ids = await loop.offload(
                tokenizer.apply_chat_template, chat, body.add_generation_prompt is not False
            )
        else:
            ids = await loop.tokenize(body.prompt or "")
            bos = tokenizer.bos_token_id
            if body.add_special_tokens is False and ids and ids[0] == bos:
                ids = ids[1:]  # the BOS encode() adds for this model
        strs = None
        if body.return_token_strs:
            strs = [tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
    except Refused as e:
        return _refuse(loop, endpoint, e.status, e.message, e.param)
    except RequestError as e:
        return _refuse(loop, endpoint, 400, str(e))
    except Exception as e:  # the template or the tokenizer choked on the client's text
        return _refuse(loop, endpoint, 400, f"cannot tokenize: {type(e).__name__}: {e}")
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": settings.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }  # fmt: skip
    )


async def _detokenize(request: Request, loop: EngineLoop, settings: ServeSettings) -> Response:
    endpoint = request.url.path
    try:
        body = _validate(DetokenizeRequest, _json_object(await request.body()), settings)
        ids = await loop.tokenize(body.tokens)  # the ids' range checked against the vocab
        text = await loop.offload(loop.engine.tokenizer.decode, ids)
    except Refused as e:
        return _refuse(loop, endpoint, e.status, e.message, e.param)
    except RequestError as e:
        return _refuse(loop, endpoint, 400, str(e))
    return JSONResponse({"prompt": text})


# -- schedtop's own routes -------------------------------------------------------------------


async def _incident(
    request: Request, loop: EngineLoop, settings: ServeSettings, recording: ServerRecording | None
) -> Response:
    endpoint = request.url.path
    if recording is None:
        return _unsupported(loop, endpoint)
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        return _refuse(loop, endpoint, 400, f"the body is not valid JSON: {e}")
    if not isinstance(data, dict) or set(data) - {"note", "window_s"}:
        return _refuse(loop, endpoint, 400, 'the body may only hold "note" and "window_s"')
    note, window = data.get("note"), data.get("window_s", settings.incident_window_s)
    if note is not None and not isinstance(note, str):
        return _refuse(loop, endpoint, 400, "note: must be a string", "note")
    if (
        isinstance(window, bool)
        or not isinstance(window, int | float)
        or not math.isfinite(window)  # JSON's Infinity and NaN, which Python reads
        or window <= 0
    ):
        return _refuse(loop, endpoint, 400, "window_s: must be a finite number > 0", "window_s")
    try:
        cut = await asyncio.to_thread(recording.incident, float(window), note)
    except ValueError as e:  # the note's length
        return _refuse(loop, endpoint, 400, str(e), "note")
    except IncidentError as e:
        retry = None if e.retry_after_s is None else max(1, math.ceil(e.retry_after_s))
        response = _refuse(loop, endpoint, e.status, str(e))
        if retry is not None:
            response.headers["Retry-After"] = str(retry)
        return response
    except (RecordingError, OSError) as e:  # a full disk, a directory gone
        return _refuse(loop, endpoint, 507, f"cannot write the incident: {e}")
    # The path is relative to the trace directory: the server's own layout is not the
    # client's business, and whoever reads the trace directory finds it there.
    return JSONResponse(
        {
            "path": cut.relative,
            "first_step": cut.first_step,
            "last_step": cut.last_step,
            "bytes": cut.size,
        }
    )


async def _trace_bytes(sub: StreamSubscription) -> AsyncIterator[bytes]:
    try:
        while True:
            chunk = await asyncio.to_thread(sub.get, STREAM_POLL_S)
            if chunk is None:
                continue
            if not chunk:
                return
            yield chunk
    finally:
        sub.close()


def _unsupported(loop: EngineLoop, endpoint: str) -> Response:
    return _refuse(
        loop,
        endpoint,
        501,
        "this server does not record (--no-trace): there is no live stream and no incident trace",
    )


# -- errors ----------------------------------------------------------------------------------


def _refuse(
    loop: EngineLoop, endpoint: str, status: int, message: str, param: str | None = None
) -> Response:
    _report_refusal(loop, endpoint, loop.clock(), status, message)
    return _error(status, message, param)


def _report_refusal(
    loop: EngineLoop, endpoint: str, received: float, status: int, message: str
) -> None:
    _Exchange(loop, endpoint, False, received).report(status, message)


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    # A 503 says when to come back (overload and shutdown pass within seconds).
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(
        error_body(message, status, param, code), status_code=status, headers=headers
    )


def _recording_state(recording: ServerRecording | None) -> dict[str, Any]:
    """The flight recorder's state for /health."""
    if recording is None:
        return {"state": "off"}
    stopped = recording.stopped
    state: dict[str, Any] = {"state": "recording" if stopped is None else "stopped"}
    if stopped is not None:
        state["reason"] = stopped
    if recording.rotate_error is not None:
        state["rotation_error"] = recording.rotate_error
    return state
