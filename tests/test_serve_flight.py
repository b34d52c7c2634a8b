"""The flight recorder's routes in process (FastAPI app on the tiny random model): the
incident route returns a trace `schedtop info` reads, and a viewer past the limit gets a
503 while the others keep streaming."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from recorder.info import summarize
from recorder.serving import ServerRecording
from schedtop_server.app import ServeSettings
from schedtop_server.server import build
from tests.model_support import tiny_engine, tiny_model


def test_incident_and_too_many_viewers(tmp_path: Path) -> None:
    engine = tiny_engine(tiny_model())
    rec = ServerRecording(engine.core, tmp_path / "run", max_viewers=1)
    settings = ServeSettings("tiny", engine.config.max_model_len)
    app, _ = build(engine, settings, 0, rec)

    async def go() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                for i in range(3):
                    r = await client.post(
                        "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 5}
                    )
                    assert r.status_code == 200, r.text
                viewer = rec.subscribe()  # the one viewer this recording serves
                r = await client.get("/v1/schedtop/stream")
                assert r.status_code == 503
                assert "viewers are attached" in r.json()["error"]["message"]
                viewer.close()
                r = await client.post("/v1/schedtop/incident", json={"note": "x"})
                assert r.status_code == 200, r.text
                reply = r.json()
                # relative to the trace directory: no server path is given away
                assert not Path(reply["path"]).is_absolute()
                path = tmp_path / reply["path"]
                info = summarize(path)
                assert info.closed_cleanly and info.num_arrivals == 3
                assert (reply["first_step"], reply["last_step"]) == (
                    info.first_step,
                    info.last_step,
                )
                assert reply["bytes"] == path.stat().st_size
                assert json.loads(path.with_suffix(".json").read_text())["note"] == "x"

    try:
        asyncio.run(go())
    finally:
        rec.close()
