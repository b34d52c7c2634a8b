"""`schedtop serve` as a real process on the tiny model: clients that go away abort their
requests (FINISHED_ABORTED in the trace, blocks back to idle), and Ctrl-C closes the
trace cleanly."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from recorder.multi import open_trace
from recorder.schema import Client, Status
from tests.model_support import write_tiny_gguf
from tests.serve_support import ServerProcess, metric


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    base = tmp_path_factory.mktemp("serve")
    model = write_tiny_gguf(base)
    traces = base / "traces"
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--trace-dir", str(traces)]
    with ServerProcess(args) as proc:
        yield proc, traces


def wait_for(url: str, check: str, value: float, timeout: float = 30.0, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics").text
        if metric(text, check, **labels) == value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{check}{labels} never became {value}:\n{text}")
        time.sleep(0.05)


LONG = {"prompt": "hello", "max_tokens": 480, "ignore_eos": True, "temperature": 0}


def test_clients_that_leave_abort_their_requests(
    server: tuple[ServerProcess, Path],
) -> None:
    proc, traces = server
    url = proc.url
    ids = []
    # A streaming client that reads three chunks, then closes the connection.
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}) as r,
    ):
        assert r.status_code == 200
        ids.append(r.headers["x-request-id"])
        lines = r.iter_lines()
        chunks = 0
        while chunks < 3:
            if next(lines).startswith("data: "):
                chunks += 1
    wait_for(url, "vllm:request_success_total", 1, finished_reason="abort")
    # A client of a whole (non-streamed) response that gives up once it runs.
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(LONG).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"{head}Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        wait_for(url, "vllm:num_requests_running", 1)
    wait_for(url, "vllm:request_success_total", 2, finished_reason="abort")
    wait_for(url, "vllm:num_requests_running", 0)
    wait_for(url, "vllm:kv_cache_usage_perc", 0)
    # A complete stream still ends with [DONE] after that.
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]

    assert proc.stop() == 0  # Ctrl-C: a clean exit, the trace closed
    (trace,) = traces.iterdir()  # the run's directory of segments
    with open_trace(trace) as reader:
        assert reader.closed_cleanly
        refs: dict[str, int] = {}
        aborted: set[int] = set()
        steps = []
        clients = []
        for e in reader.entries():
            rec = e.record
            if isinstance(rec, Client):
                clients.append(rec)
            elif hasattr(rec, "arrivals"):
                steps.append(rec)
                refs.update({a.request_id: a.ref for a in rec.arrivals})
                aborted |= {f.ref for f in rec.finishes if f.status == Status.FINISHED_ABORTED}
        usable = reader.header.num_blocks - 1
    assert refs[ids[0]] in aborted and len(aborted) == 2
    assert steps[-1].free_blocks == usable  # every block back
    gone = [c for c in clients if c.finish_reason == "abort"]
    assert len(gone) == 2 and {c.stream for c in gone} == {True, False}
    streamed = next(c for c in gone if c.stream)
    assert streamed.request_id == ids[0] and streamed.ttft_ns is not None
    assert next(c for c in gone if not c.stream).status == 499


def test_stats_show_what_the_server_adds(server: tuple[ServerProcess, Path]) -> None:
    """`schedtop stats` on a server's trace: HTTP statuses, client aborts, client-side
    timings (this test runs after the one above, on the same server's trace)."""
    import json
    import subprocess
    import sys

    from tests.serve_support import REPO

    proc, traces = server
    (trace,) = traces.iterdir()  # the run's directory of segments
    cmd = [sys.executable, "-m", "tui.cli", "stats", str(trace)]
    text = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "client aborts           2" in text
    assert "client TTFT p50 / p99" in text and "client ITL p50 / p99" in text
    assert "HTTP responses          3 (2 2xx, 1 4xx, 0 5xx; 499: 1)" in text, text
    data = json.loads(
        subprocess.run([*cmd, "--json"], cwd=REPO, capture_output=True, text=True).stdout
    )
    assert data["num_aborted"] == 2
    assert data["server"]["aborted"] == 2 and data["server"]["statuses"] == {"200": 2, "499": 1}
    assert data["server"]["ttft_p50"] > 0 and data["server"]["itl_p99"] > 0


def test_the_tui_reads_the_http_side_of_a_run_directory(
    server: tuple[ServerProcess, Path],
) -> None:
    from tui.commands import GotoEdge
    from tui.launch import open_session

    _, traces = server
    (run_dir,) = traces.iterdir()
    session = open_session(run_dir, live=False)
    try:
        session.handle(GotoEdge(end=True))
        assert session.frame().header.http == "HTTP 1 ok · 2 left"
    finally:
        session.close()


def test_a_dead_engine_ends_the_process_with_the_reason(tmp_path: Path) -> None:
    """vLLM's EngineDeadError behaviour: the request in flight gets a 500, /health stops
    answering 200, and the process exits non-zero with the reason on stderr, so that a
    supervisor restarts it."""
    model = write_tiny_gguf(tmp_path)
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--no-trace"]
    env = {"SCHEDTOP_TEST_FAIL_AFTER_STEPS": "2"}
    with ServerProcess(args, env=env, module="tests.faulty_serve") as proc:
        r = httpx.post(proc.url + "/v1/completions", json={**LONG, "max_tokens": 20}, timeout=60)
        assert r.status_code == 500 and "the engine died" in r.json()["error"]["message"]
        assert proc.proc is not None
        status = proc.proc.wait(60)  # it exits on its own
    assert status == 1
    out = "".join(proc.output)
    assert "the engine died: RuntimeError: injected engine fault" in out
