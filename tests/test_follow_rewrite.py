"""Issue 14, class 6: a reader following a trace notices when the file is truncated and
rewritten by a new run, instead of waiting at the old offset forever. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recorder.errors import TraceError
from recorder.reader import TraceReader

CASE = Path(__file__).parent / "data" / "fidelity" / "c_kv_pressure_prefix.workload.json"


def start_sim(path: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tui.cli", "sim", str(CASE), "--trace", str(path), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_size(path: Path, size: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.stat().st_size > size):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)


def test_follow_notices_a_truncated_and_rewritten_trace(tmp_path: Path) -> None:
    path = tmp_path / "live.trace"
    first = start_sim(path, "--pace", "10")
    second = None
    try:
        wait_for_size(path, 400, first)
        with TraceReader(path) as reader:
            # The file's size can pass 400 bytes on the header alone, before a whole record
            # is flushed: poll until the first run's records show up.
            deadline = time.monotonic() + 60
            seen = reader.poll()
            while not seen and time.monotonic() < deadline and first.poll() is None:
                time.sleep(0.02)
                seen = reader.poll()
            assert seen  # the first run's records
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            second = start_sim(path, "--force", "--pace", "200")  # the lock died with it
            with pytest.raises(TraceError, match="changed under the reader"):
                for _ in reader.follow(poll_s=0.02, idle_timeout_s=60):
                    pass
            with pytest.raises(TraceError, match="changed under the reader"):
                reader.scan(reader.records_start, 0, tail=True)
            assert second.wait(timeout=120) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    with TraceReader(path) as fresh:  # reopened, it is the new run's trace
        assert fresh.footer is not None and fresh.footer.num_steps == 56


def test_follow_notices_a_trace_cut_below_what_it_read(tmp_path: Path) -> None:
    path = tmp_path / "t.trace"
    subprocess.run(
        [sys.executable, "-m", "tui.cli", "sim", str(CASE), "--trace", str(path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # without its end: still "being written"
    with TraceReader(path) as reader:
        assert reader.poll()
        with open(path, "r+b") as f:
            f.truncate(reader.records_start + 10)
        with pytest.raises(TraceError, match="truncated"):
            reader.poll()
