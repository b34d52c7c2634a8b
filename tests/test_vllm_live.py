"""A vLLM recording kept as `schedtop serve` keeps one (issue 25, items 6 and 7), on vLLM's
real engine loop (tests/vllm_engine.py: its LLMEngine with the engine core in its own
process, async scheduling, a model-free executor):

- with SCHEDTOP_LIVE_PORT, `schedtop live http://127.0.0.1:PORT` (the app, headless under
  Textual's Pilot) attaches to the engine-core process while vLLM is idle, and its step
  count advances as vLLM steps; what the viewer saw equals the trace on disk;
- the API key guards the routes; POST /v1/schedtop/incident and SIGUSR1 cut incidents
  that `schedtop info` reads;
- SCHEDTOP_TRACE_MAX_BYTES rotates the segments and keeps the directory under the
  bound; the directory reads as one trace (info, stats).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from recorder.info import summarize
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.segments import INCIDENTS, list_segments
from replays.reducer import state_at
from replays.timeline import Timeline
from tests.test_vllm import ROOT, find_vllm_python, record_in_vllm, vllm_env
from tests.tui_support import app_test, wait_until
from tui.app import SchedtopApp
from tui.cli import main
from tui.launch import open_remote_session

pytestmark = pytest.mark.vllm

KEY = "live-key-25"
MAX_BYTES = 64 << 10  # the smallest bound: segments of 8 KiB, so they rotate
GATE = 30  # the driver waits at this step until the viewer is attached


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(n: int = 60) -> dict[str, Any]:
    rng = random.Random(25)
    requests = []
    for i in range(n):
        out = [rng.randint(1, 60) for _ in range(rng.randint(8, 30))]
        requests.append(
            {
                "id": f"r{i}",
                "arrival_step": 2 * i,
                "prompt_token_ids": [rng.randint(1, 50) for _ in range(rng.randint(4, 40))],
                "max_tokens": len(out),
                "output_token_ids": out,
            }
        )
    cfg = {"block_size": 16, "num_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    return {"config": cfg, "requests": requests}


def post(url: str, body: dict[str, Any], key: str | None) -> tuple[int, dict[str, Any], Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def wait_listening(port: int, proc: subprocess.Popen[str], timeout: float = 240.0) -> None:
    """Until the engine-core process listens (vLLM starts in tens of seconds here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the vLLM engine ended before it listened"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the live port never listened")


@app_test
async def test_live_attach_incidents_and_rotation_in_vllm(tmp_path: Path) -> None:
    python = find_vllm_python()
    port = free_port()
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    env = {
        "SCHEDTOP_LIVE_PORT": str(port),
        "SCHEDTOP_LIVE_API_KEY": KEY,
        "SCHEDTOP_TRACE_MAX_BYTES": str(MAX_BYTES),
    }
    spec = {
        "root": str(tmp_path),
        "check": False,
        "runs": [
            {
                "name": "live",
                "workload": workload(),
                "multiprocess": True,  # the port is the engine-core process's
                "async_scheduling": True,
                "env": env,
                "gate_at_step": GATE,
                "gate_at_end": True,
                "signal_at_step": 10,
                "step_sleep_s": 0.01,
            }
        ],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    err = (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(
        [python, "-m", "tests.vllm_engine", str(tmp_path / "spec.json"), str(tmp_path / "out")],
        cwd=ROOT,
        env=vllm_env(),
        stdout=subprocess.DEVNULL,
        stderr=err,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(port, proc)
        # Without the key: refused, as `schedtop serve` refuses.
        status, _, _ = post(url + "/v1/schedtop/incident", {}, None)
        assert status == 401
        session, stream = open_remote_session(url, KEY)
        try:
            app = SchedtopApp(session)
            async with app.run_test(size=(120, 40)) as pilot:

                def step() -> int:
                    f = app.frame
                    return -1 if f is None else f.header.step

                # vLLM waits at the gate, idle: the viewer got its state all the same.
                await wait_until(pilot, lambda: step() >= 0, timeout=60)
                first = step()
                (run_dir / "go").touch()
                await wait_until(pilot, lambda: step() >= first + 10, timeout=120)
                middle = step()
                await wait_until(pilot, lambda: step() >= middle + 10, timeout=120)
                seen = step()
            # An incident over HTTP, retried while the one the signal cut is too recent.
            deadline = time.monotonic() + 60
            while True:
                status, reply, headers = post(url + "/v1/schedtop/incident", {"note": "p99"}, KEY)
                if status != 429 or time.monotonic() > deadline:
                    break
                assert int(headers["Retry-After"]) >= 1
                time.sleep(0.2)
            assert status == 200, reply
            (run_dir / "end").touch()
            assert proc.wait(timeout=300) == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
            # The stream ended with vLLM (the viewer retries: a restarted vLLM would be
            # followed); the spool goes with the stream: a copy.
            deadline = time.monotonic() + 30
            while stream.link().connected and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not stream.link().connected
            spool = tmp_path / "seen.trace"
            shutil.copyfile(session.tl.reader.path, spool)
        finally:
            session.tl.reader.close()
            stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
    result = json.loads((tmp_path / "out").read_text())["live"]
    assert "error" not in result, result
    assert "incident written" in (tmp_path / "stderr.txt").read_text(), "SIGUSR1 cut none"

    (directory,) = [p for p in run_dir.iterdir() if p.is_dir()]
    assert directory.name.split("-")[2] == "vllm"
    incident = directory.parent / str(reply["path"])
    info = summarize(incident)
    assert info.closed_cleanly and info.last_step >= info.first_step
    segments = list_segments(directory)
    assert len(segments) >= 2 and segments[0].seq > 0, "rotated, and the oldest deleted"
    on_disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    assert on_disk <= MAX_BYTES
    assert (directory / INCIDENTS).is_dir()
    # What the viewer saw is what the recording holds, step for step.
    with TraceReader(spool) as mine, open_trace(directory) as r:
        tl = Timeline(mine)
        assert tl.first_step <= seen
        last = Timeline(r).last_step
        assert tl.last_step == last, "the viewer saw every step to the end"
        lo = max(tl.first_step, r.header.first_step)
        for s in (lo, (lo + last) // 2, last):
            assert tl.state(s).to_snapshot() == state_at(r, s).to_snapshot(), s
    out = CliRunner().invoke(main, ["info", str(directory)])
    assert out.exit_code == 0, out.output
    # (resim needs every arrival from step 0, which the bound deleted: as for serve's)
    stats = CliRunner().invoke(main, ["stats", str(directory)])
    assert stats.exit_code == 0, stats.output


def test_rotation_in_process_sync_checked_and_resimulated(tmp_path: Path) -> None:
    """The bound alone (no port, so no lock): vLLM's scheduler in the caller's process,
    sync, its state checked against the trace's after every step across the segments'
    rotations; a directory that kept every segment re-simulates exactly."""
    python = find_vllm_python()
    env = {"SCHEDTOP_TRACE_MAX_BYTES": str(MAX_BYTES)}
    # About three segments' worth (22 KiB), under the 64 KiB bound so every segment stays:
    # rotation is checked against what the encoding thread has written, which lags the
    # engine under load, and 24 requests (11 KiB) were once written as one segment in CI.
    run = {"name": "rot", "workload": workload(48), "multiprocess": False}
    results = record_in_vllm(
        python, tmp_path, [{**run, "async_scheduling": False, "env": env}], check=True
    )
    assert "error" not in results["rot"], results
    lines = (tmp_path / "rot" / "check.jsonl").read_text().splitlines()
    checks = [json.loads(line) for line in lines]
    assert checks and not [c for c in checks if c["problem"]]
    (directory,) = [p for p in (tmp_path / "rot").iterdir() if p.is_dir()]
    segments = list_segments(directory)
    assert len(segments) >= 2 and segments[0].seq == 0, [s.path.name for s in segments]
    resim = CliRunner().invoke(main, ["resim", str(directory)])
    assert resim.exit_code == 0, resim.output
