"""Run the server: an engine loop, the routes, and uvicorn on a socket bound up front (so
that `--port 0` works and the address can be printed before the first request)."""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from recorder.serving import ServerRecording
from schedtop_server.app import ServeSettings, build_app
from schedtop_server.loop import EngineDeadError, EngineLoop
from schedtop_server.metrics import ServeMetrics

if TYPE_CHECKING:
    from fastapi import FastAPI

    from engine.model.llm_engine import LLMEngine


@dataclass(frozen=True)
class Listen:
    """Where to listen and how much to queue."""

    host: str = "127.0.0.1"  # loopback unless asked otherwise
    port: int = 8000  # 0: any free port (printed once bound)
    max_waiting: int = 0  # waiting requests before 503s (0 = no bound)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in 0..65535")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting}: must be >= 0 (0 = no bound)")


def load_engine(model: str | None, overrides: dict[str, Any]) -> tuple[LLMEngine, str]:
    """The engine `schedtop run` builds with these flags (None = not given), and the
    model's name for clients: its file or directory name."""
    from engine.model.api import build_engine

    engine = build_engine(model=model, overrides=overrides)
    source = Path(engine.model.source)
    return engine, source.stem if source.is_file() else source.name


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
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server = _server_class()(config)

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

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM once it has shut down, which would end the
        process before the recording is closed: here the signal only stops serving."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for connections
            else:
                self.should_exit = True

    return Server
