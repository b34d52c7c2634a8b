"""Issue 26 items 5 and 7 in process (tiny random model, simulated engine for the
recording): every error is OpenAI-shaped JSON with the right status and 503s say when to
retry; integers that reach the trace are bounded; /health and /metrics tell the flight
recorder's state; rotation is checked on client records too and retried after a failure;
incidents are rate-limited, bounded and answered with a relative path; old server runs are
pruned."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.records import Client
from recorder.errors import RecordingError
from recorder.paths import new_run_dir
from recorder.segments import INCIDENTS, list_segments
from recorder.serving import IncidentError, ServerRecording, prune_runs
from schedtop_server.app import ServeSettings
from schedtop_server.loop import EngineLoop
from schedtop_server.server import build
from tests.model_support import tiny_engine, tiny_model
from tests.serve_support import metric
from tests.test_segments import incident_while_idle

MODEL = tiny_model()


@asynccontextmanager
async def served(
    tmp_path: Path, max_waiting: int = 0, **recording: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, EngineLoop, ServerRecording]]:
    engine = tiny_engine(MODEL, policy="priority")
    rec = ServerRecording(engine.core, tmp_path / "run", **recording)
    settings = ServeSettings("tiny", engine.config.max_model_len)
    app, loop = build(engine, settings, max_waiting, rec)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                yield client, loop, rec
    finally:
        rec.close()


def tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_integers_that_reach_the_trace_are_bounded(tmp_path: Path) -> None:
    """priority 2**64 under the priority policy used to end the flight recorder (msgpack
    overflow) while serving went on: now a 400 naming the field, and the recording goes
    on recording."""

    async def go() -> None:
        async with served(tmp_path) as (client, _, rec):
            for field, value in (
                ("priority", 2**64),
                ("priority", -(2**63) - 1),
                ("top_k", 2**64),
                ("stop_token_ids", [2**64]),
                ("min_tokens", 2**64),
            ):
                r = await client.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 2, field: value}
                )
                assert r.status_code == 400, (field, r.text)
                assert r.json()["error"]["param"].startswith(field)
            r = await client.post(
                "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 2**31 - 1}
            )
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)  # the engine thread records the client reports
            assert rec.stopped is None
            health = (await client.get("/health")).json()
            assert health["recording"] == {"state": "recording"}

    asyncio.run(go())


def test_health_and_metrics_tell_a_stopped_recording(tmp_path: Path) -> None:
    async def go() -> None:
        async with served(tmp_path) as (client, _, rec):
            text = (await client.get("/metrics")).text
            assert metric(text, "schedtop:recording") == 1
            rec._recorder.error = "step 3: OverflowError: int too big"  # as a failed write does
            r = await client.get("/health")
            assert r.status_code == 200  # serving goes on without the recording
            assert r.json() == {
                "engine": "running",
                "recording": {"state": "stopped", "reason": "step 3: OverflowError: int too big"},
            }
            text = (await client.get("/metrics")).text
            assert metric(text, "schedtop:recording") == 0

    asyncio.run(go())


def test_incident_errors_are_openai_json_with_the_right_status(tmp_path: Path) -> None:
    async def go() -> None:
        async with served(tmp_path, incident_interval_s=3600.0) as (client, _, rec):
            assert (
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            ).status_code == 200
            for body, param in (
                (b'{"window_s": Infinity}', "window_s"),
                (b'{"window_s": NaN}', "window_s"),
                (b'{"window_s": -1}', "window_s"),
                (b'{"note": "' + b"x" * 5000 + b'"}', "note"),
            ):
                r = await client.post("/v1/schedtop/incident", content=body)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == param
            r = await client.post("/v1/schedtop/incident", json={"note": "first"})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert not Path(reply["path"]).is_absolute()
            assert reply["path"].startswith(f"run/{INCIDENTS}/")
            assert (tmp_path / reply["path"]).stat().st_size == reply["bytes"]
            assert 0 <= reply["first_step"] <= reply["last_step"]
            # a second one at once: rate-limited, with Retry-After
            r = await client.post("/v1/schedtop/incident", json={"note": "second"})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert int(r.headers["retry-after"]) >= 1
            # a full disk: 507, JSON
            rec._last_incident = None

            def full(*_: Any) -> Path:
                raise RecordingError("incidents: cannot write the trace: No space left on device")

            rec._incident_path = full  # type: ignore[method-assign]
            r = await client.post("/v1/schedtop/incident", json={})
            assert r.status_code == 507
            assert "No space left" in r.json()["error"]["message"]

    asyncio.run(go())


def test_503s_carry_retry_after(tmp_path: Path) -> None:
    async def go() -> None:
        async with served(tmp_path) as (client, loop, _):
            loop.draining = True  # as a SIGTERM sets it
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "shutting down" in r.json()["error"]["message"]
            h = await client.get("/health")
            assert h.status_code == 503 and h.json()["engine"] == "draining"
            assert "retry-after" in h.headers

    asyncio.run(go())


# -- the recording alone (no server) ---------------------------------------------------------


def big_report(i: int) -> Client:
    return Client(
        after_step=-1,
        time_ns=0,
        request_id="",
        endpoint="/v1/completions",
        status=400,
        finish_reason="",
        stream=False,
        prompt_tokens=0,
        completion_tokens=0,
        queue_ns=None,
        ttft_ns=None,
        e2e_ns=1_000_000,
        itl_ns=(),
        message=f"{i}: " + "unknown field 'x…'" * 200,  # ~4 KB: what a client can make us write
    )


def test_client_records_alone_rotate_within_the_bound(tmp_path: Path) -> None:
    """No step at all, only refused requests: the bound holds (it used to be checked only
    after steps: one segment grew without limit)."""
    engine = tiny_engine(MODEL)
    bound = 256 << 10
    rec = ServerRecording(engine.core, tmp_path / "run", max_bytes=bound)
    try:
        for i in range(600):  # ~2.4 MB of records: ~9x the bound
            rec.on_client(big_report(i))
        assert len(list_segments(tmp_path / "run")) > 1
        rec.on_idle()
        assert tree_size(tmp_path / "run") <= bound
    finally:
        rec.close()
    assert tree_size(tmp_path / "run") <= bound


def test_a_failed_rotation_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(MODEL)
    now = [0]
    rec = ServerRecording(engine.core, tmp_path / "run", max_bytes=256 << 10, clock=lambda: now[0])
    real = rec._new_segment
    failures = [3]

    def flaky(previous: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise RecordingError("segment: No space left on device")
        return real(previous)

    monkeypatch.setattr(rec, "_new_segment", flaky)
    try:
        i = 0
        while failures[0] > 0 and i < 10_000:
            rec.on_client(big_report(i))
            now[0] += 2_000_000_000  # 2 s: past the retry delay each time
            i += 1
        assert rec.rotations_failed == 3 and rec.stopped is None
        for j in range(200):
            rec.on_client(big_report(j))
        assert rec.rotate_error is None, "a later rotation succeeded"
        assert len(list_segments(tmp_path / "run")) >= 2
    finally:
        rec.close()


def test_incidents_stay_within_their_share(tmp_path: Path) -> None:
    engine = tiny_engine(MODEL)
    bound = 256 << 10
    rec = ServerRecording(engine.core, tmp_path / "run", max_bytes=bound, incident_interval_s=0)
    try:
        for i in range(30):
            for j in range(5):
                rec.on_client(big_report(i * 5 + j))
            path = incident_while_idle(rec, 600.0, "x" * 4096)
            assert tree_size(tmp_path / "run") <= bound
            assert tree_size(tmp_path / "run" / INCIDENTS) <= rec.incident_max_bytes
        kept = list((tmp_path / "run" / INCIDENTS).glob("*.trace"))
        assert path in kept and len(kept) < 30, "the oldest incidents made room"
        # 600 s reach back to the start; the share (64 KiB) does not: cut to fit
        meta = json.loads(path.with_suffix(".json").read_text())
        assert meta["cut_to_bound"] is True
        rec._last_incident = rec._clock()
        rec.incident_interval_s = 60.0
        with pytest.raises(IncidentError) as e:
            rec.incident(600.0)
        assert e.value.status == 429 and e.value.retry_after_s is not None
        with pytest.raises(ValueError, match="note"):
            rec.incident(600.0, "x" * 4097)
        with pytest.raises(ValueError, match="finite"):
            rec.incident(float("inf"))
    finally:
        rec.close()


def test_old_server_runs_are_pruned(tmp_path: Path) -> None:
    runs = []
    for i in range(5):
        run = new_run_dir("serve", tmp_path, now_ns=(1_700_000_000 + i) * 10**9)
        run.mkdir()
        (run / "segment-000000.trace").write_bytes(b"x")
        runs.append(run)
    other = tmp_path / "notes"  # not a run directory: never touched
    other.mkdir()
    (tmp_path / "a.trace").write_bytes(b"x")
    gone = prune_runs(tmp_path, "serve", keep=2)
    assert gone == runs[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [runs[3].name, runs[4].name, "notes", "a.trace"]
    )
    with pytest.raises(ValueError):
        prune_runs(tmp_path, "serve", keep=0)
    assert os.path.isdir(other)
