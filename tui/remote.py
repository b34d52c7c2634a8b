"""`schedtop live http://HOST:PORT`: a server's live stream, spooled to trace files that
the ordinary Timeline follows.

The stream (GET /v1/schedtop/stream) is a trace in its own framing that starts mid-run:
preamble, HEADER, SNAPSHOT, then STEP records. A reader thread of its own (widgets never
touch sockets) checks each frame, appends it to a spool file, and so the app's worker
follows the spool exactly as it follows a trace an engine is writing: the same reader,
reducer and keyframes, stepping back included. A HEADER in the middle of the stream is a
resync (this viewer fell behind and the server skipped it to a fresh snapshot): a new
spool file starts there, and the session rebuilds its state from that snapshot.

A connection that breaks (the server was killed, restarted, or the network went) is
tried again with backoff (BACKOFF_S doubling to BACKOFF_MAX_S); the new stream starts
with its own header and snapshot, so a reconnect is a resync too. `link()` says how the
connection stands, for the header: connected, or down since when and retrying.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, replace
from pathlib import Path

from recorder.codec import MAX_RECORD_BYTES
from recorder.errors import TraceError
from recorder.framing import FRAME, FRAME_SIZE, MAGIC, PREAMBLE, PREAMBLE_SIZE, checksum
from recorder.schema import FORMAT_MAJOR, RecordType

STREAM_PATH = "/v1/schedtop/stream"
CONNECT_S = 10.0  # connecting and the response's headers
FIRST_STATE_S = 10.0  # the first header and snapshot (the server sends them between steps)
BACKOFF_S = 0.25  # the first retry after a connection broke; doubled each failed try...
BACKOFF_MAX_S = 4.0  # ...up to this


@dataclass(frozen=True, slots=True)
class Link:
    """How the connection to the server stands."""

    connected: bool  # a stream is being read
    since: float  # time.monotonic() when it last went up or down
    attempts: int  # failed reconnects since it went down
    retrying: bool  # down, and being tried again (False: closed, or a bad stream)
    error: str  # why it went down ("" while up)


class StreamError(TraceError):
    """The stream cannot be shown: no server, refused, or not a schedtop stream."""


class RemoteStream:
    """One connection to a server's stream, spooled into `spool_dir` (a fresh temporary
    directory by default, removed by close())."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        spool_dir: Path | None = None,
        reconnect: bool = True,
    ):
        self.url = url
        self.reconnect = reconnect  # try again when an attached stream breaks
        self._target = _parse(url)
        self._api_key = api_key
        self._own_spool = spool_dir is None
        if spool_dir is None:
            spool_dir = Path(tempfile.mkdtemp(prefix="schedtop-live-"))
        else:
            spool_dir.mkdir(parents=True, exist_ok=True)
        self.spool_dir = spool_dir
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._spools: list[Path] = []  # one per stream start: the first, then each resync
        self._shown = 0  # spools handed out so far
        self._file: Path | None = None  # the spool being written...
        self._fd: int | None = None  # (os.write is unbuffered: followers see each record)
        self._files = 0  # spool files started
        self._waiting_for_state = False  # ...whose header came, and its state not yet
        self.error: str | None = None  # why the stream stopped, if it did not just end
        self.ended = False  # the server ended the stream (or the connection broke)
        self.bytes_read = 0
        self._conn: http.client.HTTPConnection | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stop = threading.Event()  # close(): no more retries
        self._link = Link(False, time.monotonic(), 0, False, "")
        self._reconnected = False  # the next header starts a spool after a reconnect
        self._why: dict[Path, str] = {}  # spool -> "resync" or "reconnect"

    # -- the caller's side -------------------------------------------------------------------

    def start(self, timeout_s: float = FIRST_STATE_S) -> Path:
        """Connect, start the reader thread, and wait until the first spool file holds a
        header and the state; returns it. Raises StreamError."""
        resp = self._connect()
        self._thread = threading.Thread(
            target=self._run, args=(resp,), name="schedtop-stream", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not self._spools and not self.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(left)
            if self._spools:
                self._shown = 1
                return self._spools[0]
        self.close()
        raise StreamError(
            self.error or f"{self.url}: the stream sent no trace state within {timeout_s:.0f} s"
        )

    def link(self) -> Link:
        """How the connection stands now."""
        return self._link

    def why(self, spool: Path) -> str:
        """Why `spool` was started: "resync" (the server skipped this viewer ahead) or
        "reconnect" (the connection broke and was made again)."""
        return self._why.get(spool, "resync")

    def take_resync(self) -> Path | None:
        """The newest spool file started since the last call (a resync), if any."""
        with self._lock:
            if self._shown >= len(self._spools):
                return None
            self._shown = len(self._spools)
            return self._spools[-1]

    def close(self) -> None:
        """Disconnect, stop the thread, and remove the spool directory if it is ours."""
        self._closing = True
        self._stop.set()
        conn, sock = self._conn, self._sock
        if sock is not None:
            with contextlib.suppress(OSError):  # wakes the reader thread's recv
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if conn is not None:
            conn.close()
        if sock is not None:
            sock.close()
        self._close_spool()
        if self._own_spool:
            shutil.rmtree(self.spool_dir, ignore_errors=True)

    # -- connecting --------------------------------------------------------------------------

    def _connect(self) -> http.client.HTTPResponse:
        scheme, host, port, path = self._target
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=CONNECT_S)
        headers = {"Accept": "application/octet-stream"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        try:
            conn.request("GET", path, headers=headers)
            sock = conn.sock  # (a response that ends with the connection takes it over)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            reason = (
                e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            )
            raise StreamError(f"{self.url}: cannot connect: {reason}") from None
        if resp.status != 200:
            body = resp.read(2048).decode("utf-8", "replace").strip()
            resp.close()
            conn.close()
            if sock is not None:
                sock.close()
            raise StreamError(_refusal(self.url, resp.status, body, self._api_key is not None))
        assert sock is not None
        sock.settimeout(None)  # from here on reads block; close() shuts the socket down
        self._conn, self._sock = conn, sock
        return resp

    # -- the reader thread -------------------------------------------------------------------

    def _run(self, resp: http.client.HTTPResponse) -> None:
        try:
            while True:
                self._link = Link(True, time.monotonic(), 0, False, "")
                why = self._read(resp)
                if why is None or self._closing or not self.reconnect or not self._spools:
                    break  # a bad stream, closed by us, or it never got going: no retry
                self._link = Link(False, time.monotonic(), 0, True, why)
                next_resp = self._redial()
                if next_resp is None:
                    break
                resp = next_resp
        finally:
            self._link = replace(self._link, connected=False, retrying=False)
            with self._ready:
                self.ended = True
                self._ready.notify_all()

    def _read(self, resp: http.client.HTTPResponse) -> str | None:
        """Spool one connection's stream until it ends; why it ended (None: a stream
        that is not to be tried again, `error` says why)."""
        parser = _FrameParser()
        try:
            while True:
                data = resp.read1(1 << 16)
                if not data:
                    return "the server ended the stream"
                self.bytes_read += len(data)
                for rtype, raw in parser.feed(data):
                    self._record(rtype, raw, parser.version)
        except TraceError as e:
            self.error = f"{self.url}: {e}"
            return None
        except (OSError, http.client.HTTPException) as e:
            if not self._closing and not self.reconnect:
                self.error = f"{self.url}: the stream broke: {e}"
            return f"the stream broke: {e}"
        finally:
            resp.close()
            self._close_spool()

    def _redial(self) -> http.client.HTTPResponse | None:
        """Connect again, waiting BACKOFF_S, then twice as long after each failure (at
        most BACKOFF_MAX_S); None once close() was called."""
        delay, attempts = BACKOFF_S, 0
        old_conn, old_sock = self._conn, self._sock
        self._conn = self._sock = None
        if old_conn is not None:
            old_conn.close()
        if old_sock is not None:
            old_sock.close()
        while not self._stop.wait(delay):
            try:
                resp = self._connect()
            except StreamError as e:
                attempts += 1
                self._link = replace(self._link, attempts=attempts, error=str(e))
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            self._reconnected = True
            return resp
        return None

    def _record(self, rtype: int, raw: bytes, version: tuple[int, int]) -> None:
        if rtype == RecordType.HEADER:
            self._close_spool()
            self._file = self.spool_dir / f"stream-{self._files:03d}.trace"
            self._files += 1
            if self._reconnected:
                self._why[self._file] = "reconnect"
                self._reconnected = False
            self._fd = os.open(self._file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write(PREAMBLE.pack(MAGIC, *version))
            self._waiting_for_state = True
            self._write(raw)
            return
        if self._fd is None:
            raise TraceError("the stream's first record is not a header")
        self._write(raw)
        if self._waiting_for_state:
            # The state is whole once the first record after the header is in: the
            # snapshot, or the first step of a stream that starts at step 0.
            self._waiting_for_state = False
            with self._ready:
                assert self._file is not None
                self._spools.append(self._file)
                self._ready.notify_all()

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _close_spool(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _FrameParser:
    """Splits stream bytes into whole, checked records (the preamble first)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._started = False
        self.version = (FORMAT_MAJOR, 0)  # the stream's format, from its preamble

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buf = self._buf
        buf += data
        out: list[tuple[int, bytes]] = []
        pos = 0
        if not self._started:
            if len(buf) < PREAMBLE_SIZE:
                return out
            magic, major, minor = PREAMBLE.unpack_from(buf)
            if magic != MAGIC:
                raise TraceError("not a schedtop trace stream (wrong magic bytes)")
            if major != FORMAT_MAJOR:
                raise TraceError(
                    f"the stream is trace format {major}.{minor}; this schedtop reads "
                    f"{FORMAT_MAJOR}.x"
                )
            self._started = True
            self.version = (major, minor)
            pos = PREAMBLE_SIZE
        while len(buf) - pos >= FRAME_SIZE:
            length, rtype, crc = FRAME.unpack_from(buf, pos)
            if rtype == 0 or length > MAX_RECORD_BYTES:
                raise TraceError(f"a malformed record frame in the stream (type {rtype})")
            end = pos + FRAME_SIZE + length
            if len(buf) < end:
                break
            if checksum(rtype, memoryview(buf)[pos + FRAME_SIZE : end]) != crc:
                raise TraceError("checksum mismatch in the stream: corrupt data")
            out.append((rtype, bytes(buf[pos:end])))
            pos = end
        del buf[:pos]
        return out


def _parse(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of a server URL, with the stream's path."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise StreamError(f"{url}: not a server address (http://HOST:PORT)")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise StreamError(f"{url}: the port is not a number from 1 to 65535") from None
    base = u.path.rstrip("/")
    if base.endswith(STREAM_PATH):
        base = base[: -len(STREAM_PATH)]
    return u.scheme, u.hostname, port, base + STREAM_PATH


def _refusal(url: str, status: int, body: str, had_key: bool) -> str:
    if status == 401:
        return (
            f"{url}: the server refused the API key (401)"
            if had_key
            else f"{url}: the server wants an API key (401): pass --api-key KEY"
        )
    if status == 404:
        return f"{url}: no schedtop stream here (404): is it `schedtop serve`?"
    detail = f": {body[:200]}" if body else ""
    return f"{url}: the server answered {status}{detail}"


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))
