"""A vLLM recording kept as a server's is: rotating segments under a byte bound, old runs
pruned, incidents cut on a signal or an HTTP call, and `schedtop live` attached over HTTP.

    SCHEDTOP_TRACE_MAX_BYTES=2GiB SCHEDTOP_LIVE_PORT=7000 vllm serve MODEL \\
        --scheduler-cls recorder.vllm.RecordingScheduler
    schedtop live http://127.0.0.1:7000          # vLLM's scheduler, step by step
    kill -USR1 <engine-core pid>                 # or POST /v1/schedtop/incident

Everything here is `schedtop serve`'s machinery (recorder.serving.ServerRecording: the
segments, the bound, incidents; recorder.stream: the viewers' bounded queues), fed by the
vLLM tap instead of schedtop's engine. What differs is only where vLLM differs:

- vLLM's engine thread is inside vLLM: the recording runs between two of its scheduler
  calls (a step's end), and while vLLM is idle (blocked on its input queue, calling
  nothing) a viewer's first snapshot or an incident's flush is served from the HTTP
  thread, under a lock the scheduler's entry points take only when the live port is on.
- The HTTP side is a small threaded server of the standard library in vLLM's engine-core
  process, on 127.0.0.1 only, serving the two routes `schedtop serve` has for this
  (GET /v1/schedtop/stream, POST /v1/schedtop/incident) and /health, with the same
  bodies, so that `schedtop live` and scripts need not know which one they talk to.
- Data-parallel ranks each have their own engine core: rank r listens on PORT + r and
  records into a run directory of its own.

Off by default: without SCHEDTOP_TRACE_MAX_BYTES or SCHEDTOP_LIVE_PORT the recording is
one file, as before.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import parse_size
from engine.events import NULL_SINK
from recorder.errors import RecordingError
from recorder.paths import new_run_dir, trace_dir
from recorder.recorder import Recorder
from recorder.serving import (
    DEFAULT_KEEP_RUNS,
    DEFAULT_MAX_BYTES,
    MAX_NOTE_CHARS,
    IncidentError,
    ServerRecording,
    prune_runs,
)
from recorder.stream import StreamSubscription, TooManyViewers
from recorder.writer import TraceWriter

log = logging.getLogger("schedtop.recorder.vllm")

MAX_BYTES_ENV = "SCHEDTOP_TRACE_MAX_BYTES"
INCIDENT_MAX_BYTES_ENV = "SCHEDTOP_INCIDENT_MAX_BYTES"
KEEP_RUNS_ENV = "SCHEDTOP_TRACE_KEEP_RUNS"
INCIDENT_WINDOW_ENV = "SCHEDTOP_INCIDENT_WINDOW_S"
LIVE_PORT_ENV = "SCHEDTOP_LIVE_PORT"
LIVE_KEY_ENV = "SCHEDTOP_LIVE_API_KEY"
ENV_NAMES = (
    MAX_BYTES_ENV,
    INCIDENT_MAX_BYTES_ENV,
    KEEP_RUNS_ENV,
    INCIDENT_WINDOW_ENV,
    LIVE_PORT_ENV,
    LIVE_KEY_ENV,
)

INCIDENT_SIGNAL = signal.SIGUSR1  # `kill -USR1 PID` cuts an incident of the default window
DEFAULT_INCIDENT_WINDOW_S = 600.0  # as `schedtop serve --incident-window`
STREAM_POLL_S = 0.5  # a viewer's get() timeout: how soon an idle engine serves it
STREAM_BATCH_S = 0.1  # a viewer's stream is written at most 10 times a second
MAX_CONNECTIONS = 32  # HTTP connections served at once (viewers are 16 of them at most)
MAX_BODY_BYTES = 16 << 10  # an incident's body: a note and a window
CLOSE_WAIT_S = 1.0  # at shutdown, how long viewers' connections may take to finish
READ_TIMEOUT_S = 10.0  # a request's line, headers and body must come within this
# With a viewer attached, the recorder's thread is woken at least this often, so that
# steps reach the stream as they happen rather than in batches of 64.
LIVE_WAKE_S = 0.25


@dataclass(frozen=True, slots=True)
class Settings:
    """What the environment asks of a vLLM recording beyond one file."""

    max_bytes: int | None  # SCHEDTOP_TRACE_MAX_BYTES: segments under this bound
    incident_max_bytes: int | None  # the incidents' share (None: a quarter)
    keep_runs: int  # run directories kept in the trace directory
    incident_window_s: float  # what a signal or a bodiless POST copies
    live_port: int | None  # SCHEDTOP_LIVE_PORT (rank r listens on it + r)
    api_key: str | None  # SCHEDTOP_LIVE_API_KEY: Bearer key on /v1/*

    @property
    def segmented(self) -> bool:
        """Whether to record into a run directory of segments (else one file)."""
        return self.max_bytes is not None or self.live_port is not None


def settings(environ: Any = None) -> Settings:
    """The settings from the environment; RecordingError (one line) for a bad value."""
    env = os.environ if environ is None else environ

    def size(name: str) -> int | None:
        raw = env.get(name, "").strip()
        if not raw:
            return None
        try:
            return parse_size(raw)
        except ValueError as e:
            raise RecordingError(f"{name}: {e}") from None

    def integer(name: str, default: int | None, lo: int, hi: int) -> int | None:
        raw = env.get(name, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise RecordingError(f"{name}={raw!r}: expected a whole number") from None
        if not lo <= value <= hi:
            raise RecordingError(f"{name}={raw}: must be in {lo}..{hi}")
        return value

    max_bytes = size(MAX_BYTES_ENV)
    incident = size(INCIDENT_MAX_BYTES_ENV)
    keep = integer(KEEP_RUNS_ENV, DEFAULT_KEEP_RUNS, 1, 1 << 20)
    port = integer(LIVE_PORT_ENV, None, 1, 65535)
    raw_window = env.get(INCIDENT_WINDOW_ENV, "").strip()
    try:
        window = float(raw_window) if raw_window else DEFAULT_INCIDENT_WINDOW_S
    except ValueError:
        raise RecordingError(f"{INCIDENT_WINDOW_ENV}={raw_window!r}: expected seconds") from None
    if not (math.isfinite(window) and window > 0):
        raise RecordingError(f"{INCIDENT_WINDOW_ENV}={raw_window}: must be a number > 0")
    key = env.get(LIVE_KEY_ENV)
    if key is not None and not key.strip():
        raise RecordingError(f"{LIVE_KEY_ENV}: empty (leave it unset for no key)")
    found = Settings(max_bytes, incident, keep or DEFAULT_KEEP_RUNS, window, port, key)
    if found.segmented and env.get("SCHEDTOP_TRACE_FILE"):
        raise RecordingError(
            f"SCHEDTOP_TRACE_FILE names one file, which cannot rotate: unset it to use "
            f"{MAX_BYTES_ENV} or {LIVE_PORT_ENV} (they record into SCHEDTOP_TRACE_DIR)"
        )
    if not found.segmented and incident is not None:
        raise RecordingError(f"{INCIDENT_MAX_BYTES_ENV} needs {MAX_BYTES_ENV} (or a live port)")
    return found


class _Core:
    """The tap as a RecordedEngine (recorder.recorder) for ServerRecording and each
    segment's Recorder, which can start mid-run: `step_index` is the next step to record;
    a step in progress, or arrivals and aborts taken and not yet in a step record, are
    "unreported": no snapshot then (it would hold requests a later record adds again)."""

    def __init__(self, tap: Any) -> None:
        self._tap = tap
        self.config = tap.config
        self.sink: Any = NULL_SINK  # ServerRecording installs itself here; nothing reads it

    @property
    def step_index(self) -> int:
        return int(self._tap.next_step)

    @property
    def has_unreported(self) -> bool:
        tap = self._tap
        return tap.step is not None or bool(tap.arrivals) or bool(tap.finishes)

    arrival_clock = None  # as the tap's (recorder.recorder.TapEngine)

    def describe(self) -> tuple[str, str]:
        return self._tap.describe()  # type: ignore[no-any-return]

    def snapshot(self) -> Any:
        return self._tap.snapshot()


class VllmRecording(ServerRecording):
    """ServerRecording for the vLLM tap: the tap hands it step records (as it would a
    Recorder), it rotates segments between steps, feeds the viewers, cuts incidents.
    `lock` is held by vLLM's engine thread inside every scheduler call that changes
    state, when a live port is on: the HTTP thread takes it to serve an idle engine."""

    def __init__(
        self,
        tap: Any,
        directory: Path,
        new_recorder: Callable[[_Core, TraceWriter, Recorder | None], Recorder],
        s: Settings,
        lock: Any = None,
    ) -> None:
        core = _Core(tap)
        self._own_error: str | None = None
        # The scheduler's lock (LockingMixin) when a live port is on. Without it nothing
        # tells another thread that vLLM is idle: serve_idle* then do nothing, and an
        # incident (the signal) waits for a step, or FLUSH_WAIT_S, and takes what the
        # flush timer has written.
        self.locked = lock is not None
        self.lock = lock if lock is not None else threading.RLock()
        self.settings = s
        self.server: LiveServer | None = None
        self.incident_signal: threading.Event | None = None
        self.signal_before: Any = None  # SIGUSR1's handler before ours
        self._tap = tap
        self._last_wake = 0.0
        super().__init__(
            core,
            directory,
            max_bytes=s.max_bytes or DEFAULT_MAX_BYTES,
            incident_max_bytes=s.incident_max_bytes,
            new_recorder=lambda writer, previous: new_recorder(core, writer, previous),
        )

    # The tap reads `error` as a Recorder's: the current segment's, or this one's.
    @property
    def error(self) -> str | None:
        if self._own_error is not None:
            return self._own_error
        rec = getattr(self, "_recorder", None)
        return None if rec is None else rec.error

    @error.setter
    def error(self, value: str | None) -> None:
        self._own_error = value

    def close(self, stopped: str = "") -> None:
        """The last segment's footer, every viewer's stream ended, the port closed."""
        if self._closed:
            return
        try:
            super().close(stopped)
        finally:
            if self.server is not None:
                self.server.close()
            if self.incident_signal is not None:
                self.incident_signal.set()  # its thread sees the recording closed and ends
                if threading.current_thread() is threading.main_thread():
                    signal.signal(INCIDENT_SIGNAL, self.signal_before or signal.SIG_DFL)

    # -- the engine thread (vLLM's, inside a scheduler call) ---------------------------------

    def on_steady_step(self, *fields: Any) -> None:
        self._recorder.on_steady_step(*fields)
        self._after_step()

    def on_step(self, report: Any) -> None:
        self._recorder.on_step(report)
        self._after_step()

    def _after_step(self) -> None:
        hub = self._hub
        if hub.pending or self._flush_asked != self._flush_done:
            self._between_steps()
        if hub.live:
            now = time.monotonic()
            if now - self._last_wake >= LIVE_WAKE_S:
                self._last_wake = now
                self._recorder.wake()  # appends (so streams) what is queued; no write
        if self._rotation_due():
            self._rotate()

    def _rotation_due(self) -> bool:
        # Never with arrivals taken and not recorded: the next segment's snapshot would
        # hold them, and its first step add them again.
        return not self.core.has_unreported and super()._rotation_due()

    def flush(self) -> None:
        self._recorder.flush()

    def drain(self) -> None:
        self._recorder.drain()

    @property
    def background_thread(self) -> Any:
        return self._recorder.background_thread

    @property
    def sink(self) -> Any:
        return self._recorder.sink

    # -- other threads -------------------------------------------------------------------------

    def serve_idle(self) -> None:
        """From the HTTP side: while vLLM's engine thread calls nothing (idle), do what
        it would do between two steps (a waiting viewer's snapshot, a flush asked for)."""
        if not self.locked or not self.lock.acquire(blocking=False):
            return  # the engine thread is in a scheduler call: it serves them itself
        try:
            if not self._closed and not self.core.has_unreported:
                self._between_steps()
        finally:
            self.lock.release()

    def _wait_for_flush(self) -> None:
        if not self.serve_idle_flush():
            super()._wait_for_flush()  # the engine thread flushes after its step

    def serve_idle_flush(self) -> bool:
        """An incident's flush while vLLM is idle, which would never run it; whether it
        was done (False: vLLM is in a scheduler call, or there is no lock to tell)."""
        if not self.locked or not self.lock.acquire(blocking=False):
            return False
        try:
            if self._closed or self.core.has_unreported:
                return False
            # vLLM's thread is held out, so nothing is queued for the recorder's thread
            # once it has drained, and the writer is ours to flush.
            self._recorder.drain()
            writer = self._writer
            if writer is not None:
                writer.drain()
            return True
        finally:
            self.lock.release()

    def incident_for(self, window_s: float | None, note: str | None) -> dict[str, Any]:
        """incident() as the HTTP route and the signal answer it (the JSON reply)."""
        cut = self.incident(self.settings.incident_window_s if window_s is None else window_s, note)
        return {
            "path": cut.relative,
            "first_step": cut.first_step,
            "last_step": cut.last_step,
            "bytes": cut.size,
        }


def open_segmented(
    tap: Any,
    s: Settings,
    dp_rank: int | None,
    new_recorder: Callable[[_Core, TraceWriter, Recorder | None], Recorder],
    lock: Any = None,
) -> VllmRecording:
    """A new run directory in the trace directory (one per data-parallel rank), the
    oldest runs of the same kind beyond keep_runs deleted; the live port and the
    incident signal started when asked. RecordingError (one line) when it cannot be."""
    kind = "vllm" if dp_rank is None else f"vllm_dp{dp_rank}"
    parent = trace_dir()
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecordingError(f"{parent}: cannot create the trace directory: {e.strerror}") from None
    run = new_run_dir(kind, parent)
    try:
        recording = VllmRecording(tap, run, new_recorder, s, lock)
    except ValueError as e:
        raise RecordingError(f"{MAX_BYTES_ENV}/{INCIDENT_MAX_BYTES_ENV}: {e}") from None
    prune_runs(parent, kind, s.keep_runs)
    if s.live_port is not None:
        port = s.live_port + (dp_rank or 0)
        try:
            recording.server = LiveServer(recording, port, s.api_key)
        except OSError as e:
            recording.close()
            raise RecordingError(
                f"{LIVE_PORT_ENV}: cannot listen on 127.0.0.1:{port}: {e.strerror}"
            ) from None
        log.info("schedtop: live stream on http://127.0.0.1:%d", port)
    _install_signal(recording)
    return recording


# -- the incident signal ---------------------------------------------------------------------


def _install_signal(recording: VllmRecording) -> None:
    """`kill -USR1` cuts an incident. The handler only wakes a thread: it runs in vLLM's
    main thread, which may be the engine's, and an incident waits for a flush."""
    if threading.current_thread() is not threading.main_thread():
        log.info("schedtop: not in the main thread; no incident signal (use the live port)")
        return
    wake = threading.Event()

    def cut() -> None:
        while True:
            wake.wait()
            wake.clear()
            if recording._closed:
                return
            try:
                reply = recording.incident_for(None, "signal SIGUSR1")
                log.warning("schedtop: incident written: %s", reply["path"])
            except (IncidentError, RecordingError, OSError, ValueError) as e:
                log.warning("schedtop: no incident: %s", e)

    previous = signal.getsignal(INCIDENT_SIGNAL)
    if previous not in (signal.SIG_DFL, signal.SIG_IGN, None):
        log.warning("schedtop: SIGUSR1 has a handler already; no incident signal")
        return
    threading.Thread(target=cut, name="schedtop-incident", daemon=True).start()
    signal.signal(INCIDENT_SIGNAL, lambda *_: wake.set())
    recording.incident_signal = wake
    recording.signal_before = previous


# -- the HTTP side ---------------------------------------------------------------------------


class LiveServer:
    """127.0.0.1:PORT, a thread per connection (at most MAX_CONNECTIONS): the live
    stream, incidents and /health, as `schedtop serve` answers them."""

    def __init__(self, recording: VllmRecording, port: int, api_key: str | None) -> None:
        self.recording = recording
        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        expected = None if api_key is None else f"Bearer {api_key}".encode()

        class Handler(_Handler):
            pass

        Handler.recording = recording
        Handler.expected = expected
        Handler.live = self
        self.streaming = 0  # viewers' connections writing a stream
        self.idle = threading.Condition()  # ...notified when one ends

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request: Any, client_address: Any) -> None:
                # A flood of connections gets closed, not a thread each.
                if not slots.acquire(blocking=False):
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request: Any, client_address: Any) -> None:
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, name="schedtop-live", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        """After the streams have ended (the recording closed them): their connections
        get what is queued, at most CLOSE_WAIT_S (vLLM's process may exit right after)."""
        with self.idle:
            self.idle.wait_for(lambda: self.streaming == 0, CLOSE_WAIT_S)
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    recording: VllmRecording
    expected: bytes | None
    live: LiveServer
    timeout = READ_TIMEOUT_S  # the request line and headers (a slow client is cut)
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # vLLM's log is not ours to fill
        pass

    def _authorized(self) -> bool:
        if self.expected is None or not self.path.startswith("/v1/"):
            return True
        given = (self.headers.get("Authorization") or "").encode()
        if hmac.compare_digest(given, self.expected):
            return True
        self._json(401, _error("missing or wrong API key: send 'Authorization: Bearer KEY'"))
        return False

    def _json(
        self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = (json.dumps(body) + "\n").encode()
        # One request per connection: an idle keep-alive would hold one of the
        # MAX_CONNECTIONS threads until its read timeout.
        self.close_connection = True
        self.send_response(status)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        path = self.path.split("?", 1)[0]
        if path == "/health":
            stopped = self.recording.stopped
            state: dict[str, Any] = {"state": "recording" if stopped is None else "stopped"}
            if stopped is not None:
                state["reason"] = stopped
            self._json(200, {"status": "ok", "engine": "vllm", "recording": state})
            return
        if not self._authorized():
            return
        if path != "/v1/schedtop/stream":
            self._json(404, _error(f"no route {path}"))
            return
        try:
            sub = self.recording.subscribe()
        except TooManyViewers as e:
            self._json(503, _error(str(e)), {"Retry-After": "1"})
            return
        self._stream(sub)

    def _stream(self, sub: StreamSubscription) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        # Named, so that its CPU can be told apart (bench/vllm_record_bench.py).
        port = self.connection.getsockname()[1]
        threading.current_thread().name = f"schedtop-viewer-{port}"
        # Writes may wait for a slow viewer: only this thread waits (its queue is
        # bounded, and the recording skips it ahead or drops it, never waits for it).
        self.connection.settimeout(None)
        live = self.live
        with live.idle:
            live.streaming += 1
        try:
            while True:
                chunk = sub.get(STREAM_POLL_S)
                if chunk is None:
                    self.recording.serve_idle()  # vLLM idle: nobody else would
                    continue
                if not chunk:
                    return
                self.wfile.write(chunk)
                self.wfile.flush()
                # At most one write per STREAM_BATCH_S: a step's records queue meanwhile
                # (bounded) and go in one write; waking for each step of a fast engine
                # cost this thread (and the GIL vLLM's thread needs) several times more.
                time.sleep(STREAM_BATCH_S)
        except OSError:
            return  # the viewer went away
        finally:
            sub.close()
            with live.idle:
                live.streaming -= 1
                live.idle.notify_all()

    def do_POST(self) -> None:  # noqa: N802 -- http.server's name
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path != "/v1/schedtop/incident":
            self._json(404, _error(f"no route {path}"))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._json(413, _error(f"the body must be at most {MAX_BODY_BYTES} bytes"))
            return
        raw = self.rfile.read(length) if length else b""
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (ValueError, UnicodeDecodeError) as e:
            self._json(400, _error(f"the body is not valid JSON: {e}"))
            return
        if not isinstance(data, dict) or set(data) - {"note", "window_s"}:
            self._json(400, _error('the body may only hold "note" and "window_s"'))
            return
        note, window = data.get("note"), data.get("window_s")
        if note is not None and (not isinstance(note, str) or len(note) > MAX_NOTE_CHARS):
            self._json(400, _error(f"note: must be a string of at most {MAX_NOTE_CHARS} chars"))
            return
        if window is not None and (
            isinstance(window, bool)
            or not isinstance(window, int | float)
            or not math.isfinite(window)
            or window <= 0
        ):
            self._json(400, _error("window_s: must be a finite number > 0"))
            return
        try:
            reply = self.recording.incident_for(None if window is None else float(window), note)
        except IncidentError as e:
            headers = {}
            if e.retry_after_s is not None:
                headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_s)))
            self._json(e.status, _error(str(e)), headers)
            return
        except (RecordingError, OSError) as e:
            self._json(507, _error(f"cannot write the incident: {e}"))
            return
        self._json(200, reply)


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "schedtop"}}


def free_port() -> int:
    """A port free on 127.0.0.1 now (tests and the benchmark)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LockingMixin:
    """Over the recording scheduler when a live port is on: every scheduler call that
    changes vLLM's state (or the recording's) holds the recording's lock, so that the
    HTTP thread can take a snapshot while vLLM is idle without racing a request that
    arrives meanwhile. An uncontended RLock costs about 0.1 us a call; without a port
    this class is not there at all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._schedtop_lock = threading.RLock()
        super().__init__(*args, **kwargs)

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().add_request(*args, **kwargs)  # type: ignore[misc]

    def finish_requests(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().finish_requests(*args, **kwargs)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().update_from_output(*args, **kwargs)  # type: ignore[misc]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        with self._schedtop_lock:
            return super().shutdown(*args, **kwargs)  # type: ignore[misc]


def live_port_asked(environ: Any = None) -> bool:
    """Whether the environment asks for a live port (the scheduler then takes the lock)."""
    env = os.environ if environ is None else environ
    return bool(env.get(LIVE_PORT_ENV, "").strip())
