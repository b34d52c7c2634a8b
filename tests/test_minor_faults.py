"""Issue 14, class 8: the minor defects of the fault probe, with real files and processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from recorder.encoding import unpack_body
from recorder.errors import TraceError
from tui.cli import main

CASE = Path(__file__).parent / "data" / "fidelity" / "c_kv_pressure_prefix.workload.json"


def test_find_from_outside_the_trace_searches_from_its_end(tmp_path: Path) -> None:
    trace = tmp_path / "t.trace"
    assert CliRunner().invoke(main, ["sim", str(CASE), "--trace", str(trace)]).exit_code == 0
    first = CliRunner().invoke(main, ["find", str(trace), "preempt"])
    low = CliRunner().invoke(main, ["find", str(trace), "preempt", "--from", "-5"])
    assert low.exit_code == 0 and low.stdout == first.stdout
    high = CliRunner().invoke(main, ["find", str(trace), "preempt", "--from", "999999"])
    assert high.exit_code == 1 and "Traceback" not in high.output


def test_sim_pace_outside_its_range_is_a_usage_error() -> None:
    for pace in ("1e-300", "1e300"):
        r = CliRunner().invoke(main, ["sim", str(CASE), "--no-trace", "--pace", pace])
        assert r.exit_code == 2 and "must be 0 or in [0.01, 1e+06]" in r.stderr


def test_a_killed_writer_leaves_no_temporary_file_after_the_next_run(tmp_path: Path) -> None:
    out = tmp_path / "x.dec.jsonl"
    cmd = [sys.executable, "-m", "tui.cli", "sim", str(CASE), "--no-trace", "--decisions"]
    proc = subprocess.Popen([*cmd, str(out), "--pace", "20"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".x.dec.jsonl.*.tmp")):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob("*.tmp")) and not out.exists()
    subprocess.run([*cmd, str(out)], check=True, timeout=120, capture_output=True)
    assert out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_malformed_msgpack_errors_give_a_reason() -> None:
    try:
        unpack_body(b"\xc1")  # a reserved byte: msgpack raises with an empty message
    except TraceError as e:
        raise AssertionError("unpack_body raises its own Bad, not TraceError") from e
    except Exception as e:  # noqa: BLE001 (the codec's internal error type)
        assert "()" not in str(e) and str(e).startswith("malformed msgpack (")
    else:
        raise AssertionError("b'\\xc1' decoded")
