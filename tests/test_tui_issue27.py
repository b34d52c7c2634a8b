"""Issue 27's smaller pieces: ids cut in the middle, the link's words, the request table
keeping `prio` under the priority policy, `m` maximizing a pane, `gg` / `G`, and the
aggregate zoom's cached runs no longer drawn with a shade's glyph."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from engine.sim.driver import make_engine, run_steps
from recorder.serving import ServerRecording
from tests.test_segments import busy_workload
from tests.test_stream import drain, http_stream  # noqa: F401 -- the fixture
from tests.tui_support import app_test, at_step, make_app, screen_text, wait_until
from tui.format import middle, short_id, shorten_ids
from tui.remote import Link, RemoteStream
from tui.session import link_text
from tui.widgets.blockmap import _SHADES, CACHED_RUN
from tui.widgets.header import StepHeader
from tui.widgets.requests import RequestTable, layout

STORM = Path(__file__).resolve().parent.parent / "replays" / "incidents" / "preemption_storm.trace"
OPENAI = "chatcmpl-0001000000000000000000009e3779b1"


def test_ids_are_cut_in_the_middle() -> None:
    assert middle(OPENAI, 15) == "chatcmpl-…779b1"
    assert middle(OPENAI, 12) == "chatcm…779b1"  # no room for the whole prefix
    assert middle("r13", 5) == "r13"
    assert all(len(middle(OPENAI, w)) == w for w in range(4, 40))
    assert short_id(OPENAI) == "chatcmpl-…3779b1"
    assert shorten_ids(f"{OPENAI} admitted", (OPENAI,)) == "chatcmpl-…3779b1 admitted"


def test_the_link_in_words() -> None:
    now = time.monotonic()
    assert link_text(Link(True, now, 0, False, ""), 0) == "CONNECTED"
    assert link_text(Link(True, now, 0, False, ""), 12) == "IDLE 12s"
    assert link_text(Link(False, now, 3, True, "refused"), 0) == "DISCONNECTED (retrying)"


@pytest.mark.parametrize("width", [76, 100, 140])
def test_prio_stays_under_the_priority_policy(width: int) -> None:
    titles = [c.title for c, _, _ in layout(width, 16, True)]
    assert "prio" in titles and titles[-1] == "why not scheduled"
    assert "prio" not in [c.title for c, _, _ in layout(76, 16, False)]


def test_a_cached_run_is_not_a_shade() -> None:
    assert CACHED_RUN not in _SHADES


@app_test
async def test_maximize_and_vim_edges() -> None:
    app = make_app(STORM)
    async with app.run_test(size=(80, 24)) as pilot:
        await at_step(pilot, 0)
        await pilot.press("G")
        await at_step(pilot, 585)
        await pilot.press("g", "g")
        await at_step(pilot, 0)
        await pilot.press("m")
        await wait_until(pilot, lambda: app.screen.maximized is not None)
        assert app.screen.maximized.id == "requests-pane"
        table = app.query_one(RequestTable)
        assert table.size.height > 15  # the whole screen but the header and status line
        await pilot.press("m")
        await wait_until(pilot, lambda: app.screen.maximized is None)
        await pilot.press("tab", "tab", "m")  # the event log, then esc puts it back
        await wait_until(pilot, lambda: app.screen.maximized is not None)
        assert app.screen.maximized.id == "events-pane"
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.screen.maximized is None)


@app_test
async def test_http_counters_and_client_timings_have_lines_of_their_own_at_80() -> None:
    app = make_app(STORM)
    async with app.run_test(size=(80, 24)) as pilot:
        await at_step(pilot, 0)
        assert app.frame is not None
        http = "HTTP 120 ok · 3 4xx · 1 5xx · 4 left"
        client = "client: queue 3 ms, TTFT 41 ms, ITL p50 12 ms, HTTP 200"
        header = app.query_one(StepHeader)
        want = dataclasses.replace(
            app.frame.header, http=http, window="since attach", followed=OPENAI, client=client
        )

        def shown() -> bool:
            # The app's own frame update may land after ours (it sets the header from the
            # frame): the test's header is set again until the screen shows it.
            if header.vm != want:
                header.vm = want
            return header.size.height == 4

        await wait_until(pilot, shown)
        lines = screen_text(app).splitlines()
        assert lines[2].strip() == f"{http} (since attach)"
        assert lines[3].strip() == f"▶ {short_id(OPENAI)}  {client}"


def test_a_stream_that_ends_is_dialled_again(
    tmp_path: Path,
    http_stream: tuple[type[Any], str],  # noqa: F811 -- the fixture
) -> None:
    """The server ends the stream (here: the handler's body is all sent): the link goes
    down, is tried again, and the new stream's spool is a reconnect."""
    w = busy_workload(4)
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run")
    sub = rec.subscribe()
    data = bytearray()
    for _ in run_steps(w, engine):
        data += drain(sub)
    rec.close()
    handler, url = http_stream
    handler.body = bytes(data)
    stream = RemoteStream(url, spool_dir=tmp_path / "spool")
    try:
        first = stream.start()
        deadline = time.monotonic() + 10
        again = None
        while again is None and time.monotonic() < deadline:
            again = stream.take_resync()
            time.sleep(0.02)
        assert again is not None and again != first
        assert stream.why(again) == "reconnect" and stream.why(first) == "resync"
    finally:
        stream.close()
    assert not stream.link().connected and not stream.link().retrying


def test_a_reconnect_says_which_steps_were_not_seen() -> None:
    from replays.timeline import Timeline
    from tests.helpers import open_reader
    from tui.launch import open_session

    session = open_session(STORM, live=True, named_writer=False)
    try:
        session.restart(Timeline(open_reader(STORM), live=True), "reconnect")
        assert session.status == "reconnected to a new run of the server, at step 0"
        assert session.notes[-1].kind == "note"
    finally:
        session.close()
