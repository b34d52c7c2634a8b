"""Issue 26 items 4-6 against real `schedtop serve` processes on the tiny random model:
a SIGTERM drains (new requests 503 with Retry-After, running streams end with an error
event and [DONE], all of it in the trace); slow clients are cut; a KV pool too small for
max_model_len refuses to start; and a flood of unauthenticated requests, refused
requests and incident POSTs leaves the trace directory within its bound."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from recorder.multi import open_trace
from recorder.schema import Client
from tests.model_support import write_tiny_gguf
from tests.serve_support import REPO, ServerProcess, metric, sse_events

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model"))


def run_dir(traces: Path) -> Path:
    (run,) = [p for p in traces.iterdir() if p.is_dir()]
    return run


def clients(run: Path) -> list[Client]:
    with open_trace(run) as r:
        return [e.record for e in r.entries() if isinstance(e.record, Client)]


def tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_sigterm_drains_then_aborts_every_stream_with_done(model: Path, tmp_path: Path) -> None:
    """40 streams in flight, 8 running at a time (the rest wait): SIGTERM, a 1 s
    shutdown timeout. Every stream ends with [DONE]; those still running at the timeout
    with an error event before it; a request during the drain gets a 503 with
    Retry-After; the trace has a client record for each, and closes cleanly."""
    traces = tmp_path / "traces"
    args = ["--model", str(model), "--num-gpu-blocks-override", "256", "--max-num-seqs", "8"]
    args += ["--trace-dir", str(traces), "--shutdown-timeout", "1"]
    n = 40
    body = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "stream": True}
    results: list[list[Any]] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1, timeout=120)
    errors: list[BaseException] = []
    with ServerProcess(args) as server:

        def stream(i: int) -> None:
            try:
                with (
                    httpx.Client(timeout=120) as c,
                    c.stream("POST", server.url + "/v1/completions", json=body) as r,
                ):
                    assert r.status_code == 200, r.read()
                    started.wait()
                    results[i] = list(sse_events(r.iter_lines()))
            except BaseException as e:
                errors.append(e)
                started.abort()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its 200: all 40 are in the engine
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        refused = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
            if r.status_code == 503:
                refused = r
                break
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
        assert server.proc.wait(60) == 0
    assert not errors, errors
    assert refused is not None, "no 503 during the drain"
    assert refused.headers["retry-after"] == "1"
    assert "shutting down" in refused.json()["error"]["message"]
    aborted = 0
    for events in results:
        assert events and events[-1] == "[DONE]", events[-3:]
        if isinstance(events[-2], dict) and "error" in events[-2]:
            aborted += 1
            assert events[-2]["error"]["code"] is None
            assert "shutting down" in events[-2]["error"]["message"]
    assert aborted > 0, "the 1 s timeout left requests to abort"
    run = run_dir(traces)
    with open_trace(run) as r:
        assert r.closed_cleanly
    records = [c for c in clients(run) if c.endpoint == "/v1/completions"]
    statuses = sorted(c.status for c in records)
    assert statuses.count(503) == aborted + 1  # the aborted ones, and the refused one
    assert statuses.count(200) == n - aborted


def test_slow_headers_and_bodies_are_cut(model: Path) -> None:
    """Slowloris: 50 connections that never finish their headers are closed after the
    read timeout (they used to be held for as long as the client liked), a body that
    never finishes gets a 408, and the server still answers."""
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--no-trace"]
    with ServerProcess([*args, "--read-timeout", "1"]) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        slow = []
        for _ in range(50):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
            s.settimeout(30)
            slow.append(s)
        for s in slow:
            with contextlib.suppress(ConnectionResetError):  # closed by the server
                assert s.recv(4096) == b""
            s.close()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 1000\r\n\r\n{"prompt": '
            )
            s.settimeout(30)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), reply
        assert json.loads(payload)["error"]["code"] == "request_timeout"
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_kv_pool_too_small_for_max_model_len_refuses_to_start(model: Path) -> None:
    """vLLM refuses to start when its KV cache cannot hold max_model_len tokens; so does
    schedtop serve (it used to answer such a request 200 with finish_reason "abort")."""
    cmd = [sys.executable, "-m", "tui.cli", "serve", "--port", "0", "--no-trace"]
    cmd += ["--model", str(model), "--num-gpu-blocks-override", "8"]  # 7 x 16 = 112 tokens
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ServerProcess([]).env
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "max_model_len=512 is larger than the 112 tokens" in out.stderr
    assert "--max-model-len" in out.stderr and "Traceback" not in out.stderr


def test_floods_leave_the_trace_directory_within_its_bound(model: Path, tmp_path: Path) -> None:
    """The issue's flood scaled down: 6,000 401s made one 69.7 MB segment under a 20 MB
    bound (3.5x over) and 50 incidents 64 MB outside it. Here, under a 256 KiB bound:
    1,500 401s with 4 KB paths and 300 refused requests naming a 4 KB field (~7 MB if
    each were recorded, 27x the bound; no step runs while they come, so only a check on
    every append rotates), and 50 incident POSTs with 4 KB notes, one of 5 MB."""
    traces = tmp_path / "traces"
    bound = 256 << 10
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--api-key", KEY]
    args += ["--trace-dir", str(traces), "--trace-max-bytes", "256KiB"]
    with ServerProcess(args) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}, headers=AUTH)
        assert r.status_code == 200
        field = "f" * 4000
        for _ in range(300):
            r = c.post("/v1/completions", json={"prompt": "hi", field: 1}, headers=AUTH)
            assert r.status_code == 400
        codes = []
        for i in range(50):
            note = "x" * (5_000_000 if i == 7 else 4000)
            r = c.post("/v1/schedtop/incident", json={"note": note}, headers=AUTH)
            codes.append(r.status_code)
            assert r.headers["content-type"] == "application/json"
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
        assert codes[0] == 200 and codes[7] == 400
        assert set(codes) <= {200, 400, 429}
        # last, so that their records are in the newest segment, not rotated out
        long_path = "/v1/" + "a" * 4000
        for _ in range(1500):
            assert c.get(long_path).status_code == 401
        text = c.get("/metrics").text
        assert metric(text, "schedtop:unauthenticated_requests_total") == 1500
        assert metric(text, "schedtop:recording") == 1
        run = run_dir(traces)
        assert tree_size(run) <= bound
    assert tree_size(run) <= bound
    records = clients(run)
    unauth = [c for c in records if c.status == 401]
    assert 1 <= len(unauth) < 10  # counted, recorded at most every 10 s
    assert all(c.endpoint == "/v1/*" and "a" * 100 not in c.message for c in unauth)
