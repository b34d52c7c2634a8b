"""`schedtop live http://` in a real terminal (issue 27, item 6): a server that goes idle
and serves again is followed without a key press, idle is never "trace ended", and a
killed server shows DISCONNECTED (retrying) in the header."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_tui_terminal import Tmux, tmux  # noqa: F401 -- the fixture

REPO = Path(__file__).resolve().parent.parent
IDLE_S = 4.0  # the server's quiet spell: past the header's 3 s idle mark, and short
FIRST = 20  # steps served before it


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_stream_server", str(IDLE_S), str(FIRST)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()  # "port N steps M", once it listens
    try:
        assert line[:1] == ["port"], "the fake server did not start"
        yield proc, f"http://127.0.0.1:{line[1]}", int(line[3])
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def header(screen: str) -> str:
    return screen.splitlines()[0] if screen else ""


def test_live_http_idle_then_serving_then_killed(
    tmux: Tmux,  # noqa: F811 -- the fixture
    server: tuple[subprocess.Popen[str], str, int],
) -> None:
    proc, url, chunks = server
    tmux.start(f"live {url}")
    screen = tmux.wait_for(lambda s: "CONNECTED" in header(s), "CONNECTED")
    # The server is quiet: idle, with a count that goes up on its own (no key is sent).
    screen = tmux.wait_for(lambda s: "IDLE 3s" in header(s), "IDLE 3s")
    assert "trace ended" not in screen and "is gone" not in screen
    stalled = header(screen).split("step ")[1].split(" /")[0]
    assert int(stalled) < chunks - 1
    tmux.wait_for(lambda s: "IDLE 4s" in header(s) or "CONNECTED" in header(s), "the clock")
    # It serves again: the new steps show up without a key press.
    last = chunks - 1
    screen = tmux.wait_for(lambda s: f"step {last} / {last}" in header(s), "the new steps")
    assert "trace ended" not in screen
    # Killed: the connection drops, and the header says so (and that it retries).
    proc.kill()
    killed = time.monotonic()
    tmux.wait_for(lambda s: "DISCONNECTED (retrying)" in header(s), "DISCONNECTED")
    print(f"DISCONNECTED shown {time.monotonic() - killed:.2f} s after the kill")
    tmux("send-keys", "-t", "app", "q")
    tmux.wait_for(lambda s: "DISCONNECTED" not in s, "the app gone", may_end=True)
