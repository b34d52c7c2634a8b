"""The live stream (recorder.stream through recorder.serving): a viewer attached mid-run
gets the state at once and then every step, several come and go, a slow one skips ahead
to a fresh snapshot and a stuck one is dropped, with bounded memory and the engine never
waiting. And the client side (tui.remote) over real HTTP: it spools what it reads into
traces the Timeline follows, resyncs included."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.sim.driver import make_engine, run_steps
from recorder.reader import TraceReader
from recorder.schema import Snapshot
from recorder.serving import ServerRecording
from recorder.stream import StreamSubscription, TooManyViewers
from replays.reducer import state_at
from replays.timeline import Timeline
from tests.test_segments import busy_workload, record_file
from tui.remote import RemoteStream, StreamError


def drain(sub: StreamSubscription) -> bytes:
    out = bytearray()
    while chunk := sub.get(0):
        out += chunk
    return bytes(out)


def split_syncs(data: bytes) -> list[bytes]:
    """A stream's bytes as one trace per header (the first, then each resync)."""
    from recorder.framing import FRAME, FRAME_SIZE, PREAMBLE_SIZE, preamble

    pieces: list[bytearray] = []
    pos = PREAMBLE_SIZE
    while pos < len(data):
        length, rtype, _ = FRAME.unpack_from(data, pos)
        end = pos + FRAME_SIZE + length
        if rtype == 1:
            pieces.append(bytearray(preamble()))
        pieces[-1] += data[pos:end]
        pos = end
    return [bytes(p) for p in pieces]


def test_a_viewer_attached_mid_run_reaches_the_file_state(tmp_path: Path) -> None:
    w = busy_workload()
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run", snapshot_interval=16)
    rec.segment_bytes = 4096  # rotations while it watches: the stream goes on through them
    subs: dict[int, StreamSubscription] = {}
    got: dict[int, bytearray] = {}
    for result in run_steps(w, engine):
        step = result.report.step
        if step in (0, 17, 40):
            subs[step] = rec.subscribe()  # served at the next step's end
            got[step] = bytearray()
        if step == 60:
            subs.pop(17).close()  # one leaves mid-run
        for k, sub in subs.items():
            got[k] += drain(sub)
    rec.close()
    for k, sub in subs.items():
        got[k] += drain(sub)
        assert sub.get(0) == b"", "the stream ends when the recording closes"
        assert sub.skips == 0 and not sub.dropped
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with TraceReader(whole) as ref:
        last = ref.index().last_step
        for k in (0, 40):
            pieces = split_syncs(bytes(got[k]))
            assert len(pieces) == 1, "no resync: it kept up, rotations are invisible"
            with TraceReader.from_bytes(pieces[0]) as r:
                assert r.header.first_step == k + 2  # served at the end of the next step
                tl = Timeline(r)
                assert tl.last_step == last
                for s in (k + 2, (k + last) // 2, last):
                    assert tl.state(s).to_snapshot() == state_at(ref, s).to_snapshot()


def test_a_stuck_viewer_is_dropped_with_bounded_memory(tmp_path: Path) -> None:
    w = busy_workload()
    engine = make_engine(w)
    limit = 6000
    rec = ServerRecording(engine, tmp_path / "run", stream_limit=limit)
    stuck = rec.subscribe()
    good = rec.subscribe()
    peak = 0
    for _ in run_steps(w, engine):
        peak = max(peak, stuck.buffered)
        drain(good)
        if stuck.dropped:
            break
    assert stuck.dropped and stuck.ended
    assert 0 < peak <= limit
    assert stuck.get(0) == b""  # its stream ended, nothing queued
    assert stuck.buffered == 0
    assert not good.dropped and good.skips == 0
    rec.close()


def test_a_slow_viewer_skips_ahead_to_a_fresh_snapshot(tmp_path: Path) -> None:
    w = busy_workload()
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run", stream_limit=3000)
    slow = rec.subscribe()
    data = bytearray()
    seen = -1
    for _ in run_steps(w, engine):
        assert slow.buffered <= 3000
        if slow.skips > seen:  # it reads in bursts: once at first, then after each skip
            data += drain(slow)
            seen = slow.skips
    rec.close()
    data += drain(slow)
    assert slow.skips >= 2 and not slow.dropped
    pieces = split_syncs(bytes(data))
    assert len(pieces) == slow.skips + 1
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with TraceReader(whole) as ref:
        for piece in pieces:  # each piece: header, snapshot, steps, as from the file
            with TraceReader.from_bytes(piece) as r:
                tl = Timeline(r)  # (the steps queued before a skip were dropped)
                for s in {tl.first_step - 1, tl.last_step}:
                    assert tl.state(s).to_snapshot() == state_at(ref, s).to_snapshot()
        assert tl.last_step == ref.index().last_step


def test_viewers_are_limited_and_their_streams_end_at_close(tmp_path: Path) -> None:
    engine = make_engine(busy_workload(4))
    rec = ServerRecording(engine, tmp_path / "run", max_viewers=2)
    a, b = rec.subscribe(), rec.subscribe()
    with pytest.raises(TooManyViewers):
        rec.subscribe()
    a.close()
    c = rec.subscribe()  # a's place is free again
    rec.on_idle()  # before any step: a header alone (the initial state is implicit)
    first = c.get(0)
    assert first is not None
    with TraceReader.from_bytes(first) as r:
        assert r.header.first_step == 0 and list(r.entries()) == []
    rec.close()
    assert b.get(0.0) is not None and b.get(0.0) == b""
    assert rec.subscribe().get(0) == b"", "a stream of a closed recording is over at once"


def test_get_waits_for_a_step(tmp_path: Path) -> None:
    engine = make_engine(busy_workload(4))
    rec = ServerRecording(engine, tmp_path / "run")
    sub = rec.subscribe()
    assert sub.get(0.01) is None
    rec.on_idle()
    assert sub.get(0.01)  # the header
    assert sub.get(0.01) is None  # nothing new without a step
    rec.close()


# -- the client over HTTP ------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""
    key: str | None = None

    def do_GET(self) -> None:  # noqa: N802 -- http.server's name
        if self.key is not None and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "no key"}}')
            return
        if self.path != "/v1/schedtop/stream":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        for i in range(0, len(self.body), 777):  # odd pieces: frames split anywhere
            self.wfile.write(self.body[i : i + 777])
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_stream() -> Iterator[tuple[type[_Handler], str]]:
    handler = type("H", (_Handler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_client_spools_the_stream_and_resyncs(
    tmp_path: Path, http_stream: tuple[type[_Handler], str]
) -> None:
    w = busy_workload()
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run", stream_limit=3000)
    slow = rec.subscribe()
    data = bytearray()
    seen = -1
    for _ in run_steps(w, engine):
        if slow.skips > seen:
            data += drain(slow)
            seen = slow.skips
    rec.close()
    data += drain(slow)
    assert slow.skips >= 1
    handler, url = http_stream
    handler.body = bytes(data)
    # No reconnect: the stream ends once, and its spools are what it sent.
    stream = RemoteStream(url, spool_dir=tmp_path / "spool", reconnect=False)
    first = stream.start()
    stream._thread.join(10)  # type: ignore[union-attr]
    assert stream.ended and stream.error is None
    resync = stream.take_resync()
    assert resync is not None and resync != first
    assert stream.take_resync() is None
    spools = sorted((tmp_path / "spool").glob("stream-*.trace"))
    assert len(spools) == slow.skips + 1
    for spool, piece in zip(spools, split_syncs(bytes(data)), strict=True):
        assert spool.read_bytes() == piece
    with TraceReader(spools[-1]) as r:
        entries = [e.record for e in r.entries()]
        assert isinstance(entries[0], Snapshot)  # the state, then the steps (if any came)
    stream.close()
    assert (tmp_path / "spool").exists(), "a spool directory given by the caller stays"


def test_the_client_says_what_is_wrong(
    tmp_path: Path, http_stream: tuple[type[_Handler], str]
) -> None:
    handler, url = http_stream
    handler.key = "sesame"
    with pytest.raises(StreamError, match="wants an API key .*--api-key"):
        RemoteStream(url).start()
    with pytest.raises(StreamError, match="refused the API key"):
        RemoteStream(url, "wrong").start()
    with pytest.raises(StreamError, match="no schedtop stream here"):
        RemoteStream(url + "/elsewhere/x", "sesame")._connect()
    handler.body = b"hello, this is not a trace at all"
    with pytest.raises(StreamError, match="wrong magic bytes"):
        RemoteStream(url, "sesame").start(timeout_s=5)
    with pytest.raises(StreamError, match="not a server address"):
        RemoteStream("ftp://x")
    with pytest.raises(StreamError, match="cannot connect"):
        RemoteStream("http://127.0.0.1:1").start()


def test_schedtop_live_http_says_what_is_wrong_in_one_line(
    http_stream: tuple[type[_Handler], str],
) -> None:
    from click.testing import CliRunner

    from tui.cli import main

    handler, url = http_stream
    handler.key = "sesame"
    out = CliRunner().invoke(main, ["live", url])
    assert out.exit_code == 2
    assert out.output.strip() == (
        f"schedtop: error: {url}: the server wants an API key (401): pass --api-key KEY"
    )
    out = CliRunner().invoke(main, ["live", "http://127.0.0.1:1"])
    assert out.exit_code == 2 and "cannot connect" in out.output


def test_a_session_over_http_says_when_the_stream_ended(
    tmp_path: Path, http_stream: tuple[type[_Handler], str]
) -> None:
    from tui.launch import open_remote_session

    w = busy_workload(8)
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run")
    sub = rec.subscribe()
    data = bytearray()
    for _ in run_steps(w, engine):
        data += drain(sub)
    rec.close()
    data += drain(sub)
    handler, url = http_stream
    handler.body = bytes(data)
    session, stream = open_remote_session(url)
    try:
        # The server ended the stream: the connection is down and tried again (the
        # header says DISCONNECTED (retrying), a notice says why).
        deadline = time.monotonic() + 10
        while stream.link().connected and time.monotonic() < deadline:
            time.sleep(0.01)
        session.tick()
        assert (
            "warning",
            f"{url}: the server ended the stream; retrying",
        ) in session.notices
        assert session.tl.last_step == engine.step_index - 1
    finally:
        session.tl.reader.close()
        stream.close()
    assert not stream.spool_dir.exists(), "its own spool directory goes with it"
