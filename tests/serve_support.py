"""Helpers for the `schedtop serve` tests: a real server process on a free loopback port,
server-sent-event parsing, and reading /metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0  # model load on a busy 2-core machine


class ServerProcess:
    """`schedtop serve --port 0 ...` as a real process; `url` once it listens."""

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, module: str = "tui.cli"
    ) -> None:
        self.args = args
        self.module = module  # what `python -m` runs: the CLI, or a wrapper that injects faults
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.output: list[str] = []

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", self.module, "serve", "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, *self.args],
            cwd=REPO,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        found = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        self._reader.start()
        if not found.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.output))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("the server never got healthy:\n" + "".join(self.output))

    def _read(self, found: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if not self.url and " on http://" in line:
                self.url = line.split(" on ", 1)[1].split()[0]
                found.set()
        found.set()

    def stop(self) -> int:
        """SIGINT (Ctrl-C), as a user stops it; the exit status."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(timeout=10)  # it reads the output to its end, then the pipe closes
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sse_events(lines: Iterable[str]) -> Iterator[Any]:
    """The JSON payloads of an event stream, then the string "[DONE]" if it came."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


def stream_text(events: list[Any], chat: bool) -> str:
    parts = []
    for e in events:
        if e == "[DONE]":
            continue
        for c in e["choices"]:
            parts.append((c["delta"].get("content") or "") if chat else c["text"])
    return "".join(parts)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, value = line.rsplit(" ", 1)
        base = series.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"no sample of {name} with {labels}")
    return total
