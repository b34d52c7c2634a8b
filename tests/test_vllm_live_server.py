"""recorder.vllm.live's HTTP side without vLLM (issue 25, item 7): VllmRecording and
LiveServer fed by schedtop's own engine in place of the vLLM tap (the same step records,
the same calls), so that the routes, the key, the limits and the idle attach are checked
wherever the tests run. tests/test_vllm_live.py does it inside vLLM's engine loop."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.core import EngineCore
from engine.events import NULL_SINK
from engine.sim.driver import make_engine, run_steps
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions
from recorder.vllm.live import LiveServer, Settings, VllmRecording, open_segmented
from replays.reducer import state_at
from replays.timeline import Timeline
from tests.tui_support import demo_workload
from tui.remote import RemoteStream

KEY = "k-25"


class FakeTap:
    """What VllmRecording reads from the vLLM tap, answered by schedtop's engine."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.config = engine.config
        self.step = None
        self.arrivals: list[Any] = []
        self.finishes: list[Any] = []

    @property
    def next_step(self) -> int:
        return self.engine.step_index

    def describe(self) -> tuple[str, str]:
        return self.engine.describe()

    def snapshot(self) -> Any:
        return self.engine.snapshot()


class Forward:
    """The engine's sink: each step to the recording, as the tap hands it over."""

    def __init__(self, recording: VllmRecording) -> None:
        self.recording = recording

    def on_step(self, report: Any) -> None:
        self.recording.on_step(report)

    def close(self) -> None:
        pass


@dataclass
class Live:
    recording: VllmRecording
    url: str
    steps: Iterator[Any]
    directory: Path

    def step(self, n: int) -> None:
        for _ in range(n):
            with self.recording.lock:  # as LockingMixin holds it in vLLM's calls
                next(self.steps)


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Live]:
    w = demo_workload()
    engine = make_engine(w)

    def new_recorder(core: Any, writer: Any, previous: Recorder | None) -> Recorder:
        return Recorder(
            core,
            writer,
            RecorderOptions(background=True, flush_interval_s=1.0),
            install=False,
            continue_from=previous,
        )

    settings = Settings(64 << 10, None, 16, 600.0, 0, KEY)
    lock = threading.RLock()  # LockingMixin's, which a live port puts on vLLM's calls
    recording = VllmRecording(FakeTap(engine), tmp_path / "run", new_recorder, settings, lock)
    engine.sink = Forward(recording)
    recording.server = LiveServer(recording, 0, KEY)
    url = f"http://127.0.0.1:{recording.server.port}"
    try:
        yield Live(recording, url, iter(run_steps(w, engine)), tmp_path / "run")
    finally:
        engine.sink = NULL_SINK
        recording.close()


def call(url: str, body: bytes | None = None, key: str | None = KEY) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_routes_key_and_limits(live: Live) -> None:
    live.step(5)
    status, body = call(live.url + "/health", key=None)  # probes carry no key
    assert status == 200 and body["recording"]["state"] == "recording"
    assert call(live.url + "/v1/schedtop/stream", key=None)[0] == 401
    assert call(live.url + "/v1/schedtop/stream", key="wrong")[0] == 401
    assert call(live.url + "/v1/nothing")[0] == 404
    incident = live.url + "/v1/schedtop/incident"
    assert call(incident, b"[1]")[0] == 400
    assert call(incident, b'{"window_s": -1}')[0] == 400
    assert call(incident, b'{"note": 3}')[0] == 400
    assert call(incident, b"x" * (64 << 10))[0] == 413
    status, body = call(incident, b'{"note": "slow", "window_s": 60}')
    assert status == 200, body
    cut = live.directory.parent / body["path"]
    with TraceReader(cut) as r:
        assert r.header.first_step == 0 and body["last_step"] == 4
    assert json.loads(cut.with_suffix(".json").read_text())["note"] == "slow"
    status, body = call(incident, b"{}")  # as often as serve allows, no more
    assert status == 429 and "one incident per" in body["error"]["message"]


def test_a_viewer_attaches_to_an_idle_engine_and_follows_it(live: Live, tmp_path: Path) -> None:
    live.step(5)  # ...then nothing steps: only the HTTP side can serve the viewer
    stream = RemoteStream(live.url, KEY, spool_dir=tmp_path / "spool")
    try:
        spool = stream.start(timeout_s=30)
        with TraceReader(spool) as r:
            assert r.header.first_step == 5
        live.step(40)
        # The stream reaches step 44: the recorder's thread hands it on within its tick.
        with TraceReader(spool) as r:
            tl = Timeline(r, live=True)
            deadline = time.monotonic() + 30
            while tl.last_step < 44 and time.monotonic() < deadline:
                assert not stream.ended
                time.sleep(0.02)  # the spool grows on the stream's thread
                tl.refresh()
            assert tl.last_step == 44
            # A viewer gets records as they are appended; the file, at the next flush.
            live.recording.serve_idle_flush()
            with open_trace(live.directory) as disk:
                for s in (5, 20, 44):
                    assert tl.state(s).to_snapshot() == state_at(disk, s).to_snapshot()
    finally:
        stream.close()


def test_open_segmented_keeps_runs_and_cuts_an_incident_on_sigusr1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path))
    for i in range(3):  # three older vLLM runs, and a server's that is not vLLM's
        for kind in ("vllm", "serve"):
            old = tmp_path / f"2020010{i}-000000.000-{kind}-1"
            old.mkdir()
            (old / "segment-000000.trace").write_bytes(b"")
    w = demo_workload()
    engine = make_engine(w)

    def new_recorder(core: Any, writer: Any, previous: Recorder | None) -> Recorder:
        return Recorder(
            core,
            writer,
            RecorderOptions(flush_interval_s=1.0),
            install=False,
            continue_from=previous,
        )

    # No live port, so no lock: the incident waits for a step that never comes (2 s),
    # then takes what the flush timer has written.
    settings = Settings(64 << 10, None, 2, 600.0, None, None)
    recording = open_segmented(FakeTap(engine), settings, None, new_recorder)
    try:
        assert (
            sorted(p.name.split("-")[2] for p in tmp_path.iterdir()) == ["serve"] * 3 + ["vllm"] * 2
        ), "the newest 2 vLLM runs kept, this one included; serve's untouched"
        assert recording.directory.parent == tmp_path
        engine.sink = Forward(recording)
        steps = iter(run_steps(w, engine))
        for _ in range(8):
            next(steps)
        os.kill(os.getpid(), signal.SIGUSR1)
        incidents = recording.directory / "incidents"
        deadline = time.monotonic() + 30
        while not list(incidents.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.02)  # the signal wakes the recording's incident thread
        (note,) = incidents.glob("*.json")
        meta = json.loads(note.read_text())
        assert meta["note"] == "signal SIGUSR1" and meta["last_step"] == 7
    finally:
        engine.sink = NULL_SINK
        recording.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
