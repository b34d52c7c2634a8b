"""Run the server: an engine loop, the routes, and uvicorn on a socket bound up front (so
that `--port 0` works and the address can be printed before the first request)."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import UserError
from recorder.serving import ServerRecording
from schedtop_server.app import ServeSettings, build_app
from schedtop_server.loop import EngineDeadError, EngineLoop
from schedtop_server.metrics import ServeMetrics

if TYPE_CHECKING:
    from fastapi import FastAPI

    from engine.model.llm_engine import LLMEngine


DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
ABORT_GRACE_S = 10.0  # after aborting, how long handlers get to send their last events
HANDLER_GRACE_S = 5  # uvicorn's own wait for connections to close, once draining ended


log = logging.getLogger("schedtop.serve")


@dataclass(frozen=True)
class Listen:
    """Where to listen and how much to queue."""

    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000  # 0: any free port (printed once bound)
    max_waiting: int = 0  # waiting requests before 503s (0 = no bound)
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # running requests may finish

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in 0..65535")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting}: must be >= 0 (0 = no bound)")
        if not (math.isfinite(self.shutdown_timeout_s) and self.shutdown_timeout_s >= 0):
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout_s}: must be a number >= 0")


def load_engine(model: str | None, overrides: dict[str, Any]) -> tuple[LLMEngine, str]:
    """The engine `schedtop run` builds with these flags (None = not given), and the
    model's name for clients: its file or directory name. Raises KVPoolTooSmall (a
    UserError: one line, exit status 2) when the KV pool cannot hold one request of
    max_model_len tokens."""
    from engine.model.api import build_engine

    engine = build_engine(model=model, overrides=overrides)
    check_kv_pool(engine)
    source = Path(engine.model.source)
    return engine, source.stem if source.is_file() else source.name


class KVPoolTooSmall(UserError):
    """The KV pool cannot hold one request of max_model_len tokens."""


def check_kv_pool(engine: LLMEngine) -> None:
    """A server must be able to run the longest request it accepts: vLLM refuses to
    start when its KV cache cannot hold max_model_len tokens. Without this check, such a
    request is accepted and then finished by the scheduler as one that can never fit."""
    config = engine.config
    fits = config.usable_blocks * config.block_size
    if config.max_model_len > fits:
        raise KVPoolTooSmall(
            f"max_model_len={config.max_model_len} is larger than the {fits} tokens the KV "
            f"pool can hold ({config.usable_blocks} usable blocks of {config.block_size}): "
            f"a request that long could never run; lower --max-model-len to {fits} or give "
            "the pool more blocks"
        )


def build(
    engine: LLMEngine,
    settings: ServeSettings,
    max_waiting: int = 0,
    recording: ServerRecording | None = None,
) -> tuple[FastAPI, EngineLoop]:
    """The app and its engine loop (started by the app's lifespan)."""
    metrics = ServeMetrics(
        settings.model_name, engine.config.max_model_len, engine.config.enable_prefix_caching
    )
    loop = EngineLoop(
        engine,
        max_waiting=max_waiting,
        metrics=metrics,
        on_idle=recording.on_idle if recording is not None else None,
    )
    return build_app(loop, settings, metrics, recording), loop


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; an OSError names the address when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


def serve_forever(
    engine: LLMEngine,
    settings: ServeSettings,
    listen: Listen,
    recording: ServerRecording | None = None,
    on_listening: Callable[[str], None] | None = None,
    sock: socket.socket | None = None,
) -> EngineLoop:
    """Serve until SIGINT/SIGTERM on `sock` (default: bind `listen`'s address now);
    returns the stopped loop (its stats). Raises EngineDeadError (a SystemExit: the
    process ends with status 1 and the reason on stderr) when the engine thread failed."""
    import uvicorn

    app, loop = build(engine, settings, listen.max_waiting, recording)
    if sock is None:
        sock = bind(listen.host, listen.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    if on_listening is not None:
        on_listening(f"http://{shown}:{port}")
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        # Our own drain (GracefulServer) runs first; this is only for the handlers to
        # send their last events once every request has ended or been aborted.
        timeout_graceful_shutdown=HANDLER_GRACE_S,
        lifespan="on",
        http=_protocol_class(settings.read_timeout_s),
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = _server_class()(config)
    server.engine_loop = loop
    server.shutdown_timeout_s = listen.shutdown_timeout_s

    def dead(reason: str) -> None:
        # From the engine thread: uvicorn polls should_exit, then shuts down as on SIGTERM.
        server.should_exit = True

    loop.on_dead = dead
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if loop.dead_reason is not None:
        raise EngineDeadError(loop.dead_reason)
    return loop


def _server_class() -> Any:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM once it has shut down, which would end the
        process before the recording is closed: here the signal only stops serving.

        And it stops serving gracefully (issue 26 item 6): uvicorn alone would give
        running requests 5 s, then cancel their handlers before the engine aborts them
        (plain-text 500s, streams cut without [DONE], none of it in the trace). Here the
        first signal starts a drain: new requests get a 503 with Retry-After, running ones
        may finish within shutdown_timeout_s, then the engine aborts what is left and each
        of them ends with an error (an error event and [DONE] on a stream), recorded;
        only then does uvicorn close the connections. A second signal aborts at once; a
        third Ctrl-C stops waiting for connections."""

        engine_loop: EngineLoop | None = None
        shutdown_timeout_s = DEFAULT_SHUTDOWN_TIMEOUT_S
        _drain_deadline: float | None = None  # monotonic: abort what still runs after this
        _aborted_at: float | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            loop = self.engine_loop
            if loop is None or self.should_exit:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # stop waiting for connections
                self.should_exit = True
            elif self._drain_deadline is None:
                loop.draining = True
                self._drain_deadline = time.monotonic() + self.shutdown_timeout_s
            else:
                self._drain_deadline = time.monotonic()  # a second signal: abort now

        async def on_tick(self, counter: int) -> bool:
            loop = self.engine_loop
            if loop is not None and self._drain_deadline is not None and not self.should_exit:
                self._drain(loop)
            return bool(await super().on_tick(counter))

        def _drain(self, loop: EngineLoop) -> None:
            assert self._drain_deadline is not None
            now = time.monotonic()
            if loop.idle or not loop.alive:
                self.should_exit = True
            elif now >= self._drain_deadline:
                if self._aborted_at is None:
                    self._aborted_at = now
                    log.warning("shutdown: aborting the %d requests still running", loop.stats.live)
                elif now - self._aborted_at > ABORT_GRACE_S:
                    self.should_exit = True  # the engine does not answer: stop anyway
                    return
                # Again each tick: a request admitted meanwhile (it was being tokenized
                # when the drain began) is aborted too.
                loop.abort_all(
                    "the server is shutting down: this request was aborted "
                    f"after the {self.shutdown_timeout_s:g} s shutdown timeout",
                    503,
                )

    return GracefulServer


LARGE_READ_BYTES = 4 << 20  # recv() size once a request's body is large (TimedH11Protocol)


def _protocol_class(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a header read timeout: a connection whose request
    headers have not all arrived `read_timeout_s` after its first byte (or after it was
    opened) is closed. uvicorn bounds a header's size (h11's max incomplete event size)
    and the idle time between requests (timeout_keep_alive), not the time a client may
    take to send one: 200 connections trickling headers were held for as long as they
    liked. The body's time is bounded by the app (app._BodyLimit), which can answer 408."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _read_size: int | None = None  # the transport's recv() size, before any raise

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._arm()  # the first bytes of the next request on a kept-alive connection
            self._widen(len(data))
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._disarm()  # the keep-alive timeout takes over until the next bytes
            self._narrow()
            super().on_response_complete()

        def _widen(self, got: int) -> None:
            """A read that filled asyncio's recv() buffer (256 KiB): a large body is
            coming. Read it in bigger pieces: each read is an event-loop turn (and a
            pause/resume of uvicorn's 64 KiB flow control, and a wait for the GIL while
            the engine thread steps); a chunked 20 MB body, which can only be refused
            once the bytes counted pass --max-body-size, took 32 turns per 8 MiB and
            74 ms under a streaming load (issue 26 done-when 2)."""
            size = getattr(self.transport, "max_size", None)
            if isinstance(size, int) and got >= size and size < LARGE_READ_BYTES:
                self._read_size = self._read_size or size
                self.transport.max_size = LARGE_READ_BYTES  # type: ignore[attr-defined]

        def _narrow(self) -> None:
            """Back to the default once the response is out: a small request's read
            should not allocate a large buffer."""
            if self._read_size is not None:
                self.transport.max_size = self._read_size  # type: ignore[attr-defined]
                self._read_size = None

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(read_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expired(self) -> None:
            self._header_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()

    return TimedH11Protocol
