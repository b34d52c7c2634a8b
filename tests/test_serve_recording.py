"""`schedtop serve`'s flight recorder, end to end: the real server (on the tiny random
model, as a GGUF file: fast to load and to step) as a real process on a free loopback
port, real HTTP clients, and what it leaves on disk.

- `schedtop live http://...` (the app, under Textual's Pilot) shows running requests
  during a load; its state at a step equals the trace directory's at the same step;
- a small --trace-max-bytes keeps the directory under the bound, every kept segment reads
  on its own, and the directory reads as one trace;
- POST /v1/schedtop/incident returns a file `schedtop info` reads, covering the window;
- kill -9 of the server loses no step it had flushed (it flushes when idle).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from recorder.info import summarize
from recorder.multi import SegmentedReader, open_trace
from recorder.reader import TraceReader
from recorder.segments import list_segments
from replays.reducer import state_at
from replays.stats import trace_stats
from replays.timeline import Timeline
from tests.model_support import write_tiny_gguf
from tests.serve_support import metric
from tests.tui_support import app_test, wait_until
from tui.app import SchedtopApp
from tui.cli import main
from tui.launch import open_remote_session
from tui.remote import RemoteStream
from tui.viewmodel import Frame

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-123"

pytestmark = pytest.mark.slow


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    directory: Path  # this run's segment directory
    drain: threading.Thread  # reads the server's output to its end

    def post(self, path: str, body: dict[str, object], timeout: float = 120.0) -> dict[str, object]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())  # type: ignore[no-any-return]


def start_server(trace_dir: Path, *extra: str) -> Server:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tui.cli", "serve", "--port", "0", "--api-key", KEY]
        + ["--trace-dir", str(trace_dir), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        m = re.search(r"on (http://\S+)\s+\(trace: (.+)\)", line)
        if m:
            drain = threading.Thread(target=proc.stdout.read, daemon=True)
            drain.start()
            return Server(proc, m.group(1), Path(m.group(2)), drain)
        if time.monotonic() > deadline:
            break
    proc.kill()
    out = proc.stdout.read()
    proc.wait()
    proc.stdout.close()
    raise AssertionError(f"the server did not start: {out}")


def stop(s: Server) -> None:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGINT)
        try:
            s.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()
    s.drain.join(timeout=10)
    assert s.proc.stdout is not None
    s.proc.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module (the tests run in order; the last one kills it): a 128 KiB
    bound, half of it for incidents (they count against it; half, the most allowed, so
    that the incident below holds every segment kept), and a small KV pool so that an
    opening snapshot stays small."""
    base = tmp_path_factory.mktemp("serve-rec")
    s = start_server(
        base / "traces",
        "--model",
        str(write_tiny_gguf(base)),
        "--trace-max-bytes",
        "128KiB",
        "--incident-max-bytes",
        "64KiB",
        "--num-gpu-blocks-override",
        "256",
        "--max-num-seqs",
        "8",
    )
    yield s
    stop(s)


class Load:
    """n concurrent completions (bounded: each ends after max_tokens), from threads. Long
    prompts make big arrival records (their token ids) at little cost."""

    def __init__(self, server: Server, n: int, max_tokens: int, prompt_words: int = 0) -> None:
        self.errors: list[BaseException] = []
        long = "the sea is wide and deep. " * (prompt_words // 6)
        body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        self.threads = [
            threading.Thread(target=self._one, args=(server, {**body, "prompt": f"{long}{i}"}))
            for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def _one(self, server: Server, body: dict[str, object]) -> None:
        try:
            server.post("/v1/completions", body)
        except BaseException as e:  # noqa: BLE001 -- reported by done()
            self.errors.append(e)

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def done(self) -> None:
        for t in self.threads:
            t.join()
        assert not self.errors, self.errors


def wait_idle_flushed(server: Server, last_step: int, timeout: float = 20.0) -> None:
    """Until the directory shows `last_step` (the engine thread flushes when idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open_trace(server.directory) as r:
                if r.index().last_step >= last_step:
                    return
        except Exception:
            pass
        time.sleep(0.1)
    raise AssertionError(f"step {last_step} never reached {server.directory}")


def wait_generated(server: Server, timeout: float = 60.0) -> None:
    """Until the engine has sampled a token (its /metrics say so)."""
    req = urllib.request.Request(
        server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if metric(resp.read().decode(), "vllm:generation_tokens_total") >= 1:
                return
        time.sleep(0.05)
    raise AssertionError("no token generated")


@app_test
async def test_live_over_http_shows_the_load_and_matches_the_trace(server: Server) -> None:
    first = Load(server, 8, max_tokens=200, prompt_words=60)
    wait_generated(server)  # the viewer attaches mid-run: after the first steps
    session, stream = open_remote_session(server.url, KEY)
    try:
        app = SchedtopApp(session)
        async with app.run_test(size=(120, 40)) as pilot:
            more = Load(server, 16, max_tokens=200, prompt_words=60)

            shown: list[Frame] = []  # the frame that showed them (app.frame moves on)

            def running() -> bool:
                f = app.frame
                if f is not None and f.header.running >= 2 and f.header.mode == "LIVE":
                    shown.append(f)
                return bool(shown)

            await wait_until(pilot, running, timeout=60)
            assert sum(r.state == "running" for r in shown[0].requests) >= 2
            # other viewers come and go meanwhile
            for _ in range(3):
                other = RemoteStream(server.url, KEY)
                with TraceReader(other.start()) as r:
                    assert r.header.first_step > 0
                other.close()
            while first.running or more.running:
                await pilot.pause(0.1)
            first.done()
            more.done()

            def idle() -> bool:
                f = app.frame
                return f is not None and f.header.running == 0 and f.header.waiting == 0

            await wait_until(pilot, idle, timeout=30)
            assert app.frame is not None
            step = app.frame.header.step
            spool = session.tl.reader.path  # what the viewer read, spooled
        assert step > 0
        wait_idle_flushed(server, step)
        with TraceReader(spool) as mine, open_trace(server.directory) as r:
            tl = Timeline(mine)
            assert tl.first_step > 0, "attached mid-run: the stream started with a snapshot"
            assert tl.last_step >= step
            lo = max(tl.first_step, r.header.first_step)  # (old segments go: 128 KiB bound)
            for s in (lo, (lo + step) // 2, step):
                assert tl.state(s).to_snapshot() == state_at(r, s).to_snapshot(), s
    finally:
        session.tl.reader.close()
        stream.close()


def test_rotation_incident_and_kill_9(server: Server) -> None:
    Load(server, 120, max_tokens=4, prompt_words=90).done()
    # an incident of the last 10 minutes: everything still kept
    reply = server.post("/v1/schedtop/incident", {"note": "slow"})
    path = server.directory.parent / str(reply["path"])
    info = summarize(path)
    assert info.closed_cleanly and info.num_finishes >= 1
    out = CliRunner().invoke(main, ["info", str(path)])
    assert out.exit_code == 0 and "closed    yes, cleanly" in out.output
    segs = list_segments(server.directory)
    assert segs[0].seq > 0, "a 128 KiB bound deleted old segments"
    # the whole directory, the incident included, within the bound
    assert sum(f.stat().st_size for f in server.directory.rglob("*") if f.is_file()) <= 128 << 10
    with TraceReader(segs[0].path) as oldest:
        assert info.first_step <= oldest.header.first_step
    # every kept segment reads on its own; the directory as one trace
    for seg in segs[:-1]:
        assert trace_stats(seg.path).num_steps > 0
        found = CliRunner().invoke(main, ["find", str(seg.path), "free<100000"])
        assert found.exit_code == 0, found.output
    with open_trace(server.directory) as r:
        assert isinstance(r, SegmentedReader)
        tl = Timeline(r)
        last = tl.last_step
        for s in range(tl.first_step, last + 1):
            tl.state(s)  # every step applies to the one before it
        assert info.last_step <= last
    # the server is idle: everything is flushed; kill -9 loses none of it
    wait_idle_flushed(server, last)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    with open_trace(server.directory) as r:
        assert not r.closed_cleanly
        assert r.index().last_step >= last
    out = CliRunner().invoke(main, ["info", str(server.directory)])
    assert out.exit_code == 0 and "closed    no" in out.output
