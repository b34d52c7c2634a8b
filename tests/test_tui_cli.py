"""The TUI's commands on bad input, attaching with no arguments, and `schedtop demo`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from recorder.reader import TraceReader
from tests.tui_support import fixed_trace
from tui import launch
from tui.cli import main
from tui.demo import engine_command


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fixed_trace(tmp_path_factory.mktemp("cli"))


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def one_line_error(result: Result, status: int = 2) -> str:
    """The command failed with `status` and one line on stderr, and no traceback."""
    assert result.exit_code == status, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["replay", "live"])
def test_a_missing_file(tmp_path: Path, command: str) -> None:
    line = one_line_error(schedtop(command, str(tmp_path / "nope.trace")))
    assert line == f"schedtop: error: {tmp_path / 'nope.trace'}: no such file"


def test_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, this is not a trace\n")
    line = one_line_error(schedtop("replay", str(path)))
    assert "not a schedtop trace (wrong magic bytes)" in line


def test_a_directory_without_segments(tmp_path: Path) -> None:
    line = one_line_error(schedtop("replay", str(tmp_path)))
    assert "a directory without trace segments" in line


def test_a_trace_cut_inside_its_header(tmp_path: Path, good: Path) -> None:
    path = tmp_path / "short.trace"
    path.write_bytes(good.read_bytes()[:40])
    assert "the header record is incomplete" in one_line_error(schedtop("replay", str(path)))


def test_a_corrupt_trace_names_the_byte(tmp_path: Path, good: Path) -> None:
    with TraceReader(good) as reader:
        offset = reader.index().step_offsets[40]
    data = bytearray(good.read_bytes())
    data[offset + 12] ^= 0xFF  # inside step 40's body: its checksum no longer matches
    path = tmp_path / "corrupt.trace"
    path.write_bytes(bytes(data[: len(data) - 200]))  # and no footer: the reader scans
    line = one_line_error(schedtop("replay", str(path)))
    assert f"at byte {offset}: checksum mismatch" in line


def test_a_cut_trace_opens_but_needs_a_terminal(tmp_path: Path, good: Path) -> None:
    """A cut tail is no reason to refuse a trace (the app says where it is cut); here,
    with no terminal, the command says it needs one."""
    path = tmp_path / "cut.trace"
    path.write_bytes(good.read_bytes()[:5000])
    line = one_line_error(schedtop("replay", str(path)))
    assert "needs a terminal" in line


def test_a_bad_breakpoint(good: Path) -> None:
    result = schedtop("replay", str(good), "--break", "preempt", "--break", "bogus")
    assert result.exit_code == 2
    assert "--break" in result.stderr and "unknown" in result.stderr
    assert "Traceback" not in result.output


def test_no_arguments_and_no_trace_says_how_to_start_one(trace_dir: Path) -> None:
    result = schedtop()
    assert result.exit_code == 1
    assert f"no trace in {trace_dir}" in result.stderr
    for command in ("schedtop demo", "schedtop run", "schedtop sim"):
        assert command in result.stderr


def test_attaching_picks_the_newest_trace_being_written(trace_dir: Path, good: Path) -> None:
    trace_dir.mkdir()
    data = good.read_bytes()
    with TraceReader(good) as reader:
        cut = reader.index().step_offsets[50]
    old_live = trace_dir / f"20260101-000000.000-run-{os.getpid()}.trace"  # writer: alive
    old_live.write_bytes(data[:cut])
    finished = trace_dir / "20260101-000001.000-sim-1.trace"
    finished.write_bytes(data)
    assert launch.choose() == launch.Choice(old_live, True)
    old_live.write_bytes(data)  # its writer closed it: nothing is being written
    assert launch.choose() == launch.Choice(finished, False)
    stale = trace_dir / "20260101-000002.000-sim-999999999.trace"  # no such process
    stale.write_bytes(data[:cut])
    long_ago = time.time() - 3600
    os.utime(stale, (long_ago, long_ago))
    assert launch.choose() == launch.Choice(stale, False)  # a crashed writer's: replayed
    os.utime(stale)  # ...even if it changed a moment ago: its writer is gone
    assert launch.choose() == launch.Choice(stale, False)
    nameless = trace_dir / "20260101-000003.000-sim.trace"  # no pid: its age decides
    nameless.write_bytes(data[:cut])
    assert launch.choose() == launch.Choice(nameless, True)
    os.utime(nameless, (long_ago, long_ago))
    assert launch.choose() == launch.Choice(nameless, False)
    (trace_dir / "20260101-000004.000-sim-1.trace").write_text("garbage")  # skipped
    assert launch.choose() == launch.Choice(nameless, False)


def test_demo_headless_runs_the_simulated_engine_in_another_process(trace_dir: Path) -> None:
    result = schedtop("demo", "--headless", "--sim", "--pace", "0")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("engine: simulated model, pid ")
    assert int(lines[0].split("pid ")[1].split(",")[0]) != os.getpid()
    progress = [line for line in lines if line.startswith("step ")]
    assert progress and "running    0  waiting    0  free blocks    95/95" in progress[-1]
    assert "preemptions 6" in progress[-1]
    assert "(queued: steps from arrival to first scheduled" in result.stdout  # its summary
    traces = list(trace_dir.glob("*-demo-*.trace"))
    assert len(traces) == 1 and f"trace: {traces[0]}" in lines[-1]
    with TraceReader(traces[0]) as reader:
        assert reader.closed_cleanly and reader.index().last_step == 162


def test_demo_runs_the_real_engine_by_default(tmp_path: Path) -> None:
    path = tmp_path / "x.trace"
    assert engine_command(path, sim=False, pace=25) == [
        sys.executable,
        "-m",
        "tui.cli",
        "run",
        "--trace",
        str(path),
    ]
    assert engine_command(path, sim=True, pace=25)[3:] == [
        "sim",
        "--trace",
        str(path),
        "--pace",
        "25",
    ]


def test_sim_pace_sleeps_between_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = Path(__file__).parent / "data" / "fidelity" / "a_decode_plus_arrival.workload.json"
    now = [1000.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # a clock that moves only when the engine sleeps
        sleeps.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    path = tmp_path / "paced.trace"
    result = schedtop("sim", str(case), "--trace", str(path), "--pace", "200")
    assert result.exit_code == 0, result.output
    with TraceReader(path) as reader:
        steps = reader.index().last_step + 1
    assert len(sleeps) == steps
    assert all(s == pytest.approx(0.005) for s in sleeps[1:])


def test_help_is_fast_and_lists_the_commands() -> None:
    result = schedtop("--help")
    assert result.exit_code == 0
    for command in ("live", "replay", "demo", "sim", "info"):
        assert f"  {command} " in result.stdout
