"""`schedtop sim --trace`, the default trace directory, and `schedtop info`."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from recorder.framing import preamble
from recorder.paths import latest_trace, new_trace_path
from recorder.reader import TraceReader
from tui.cli import main

FIDELITY = Path(__file__).parent / "data" / "fidelity"
CASE = str(FIDELITY / "c_kv_pressure_prefix.workload.json")


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def test_sim_records_where_trace_says_and_info_describes_it(
    tmp_path: Path, trace_dir: Path
) -> None:
    path = tmp_path / "c.trace"
    result = schedtop("sim", CASE, "--trace", str(path))
    assert result.exit_code == 0, result.output
    assert f"trace: {path}" in result.stdout
    assert not trace_dir.exists()
    info = schedtop("info", str(path))
    assert info.exit_code == 0
    assert "steps     56 (0..55)" in info.stdout
    assert "requests  3 arrived, 3 finished  preemptions 1" in info.stdout
    assert "closed    yes, cleanly" in info.stdout


def test_sim_records_into_the_trace_directory_by_default(trace_dir: Path) -> None:
    first = schedtop("sim", CASE)
    second = schedtop("sim", CASE, "--redact-prompts")
    assert first.exit_code == second.exit_code == 0
    traces = sorted(trace_dir.iterdir())
    assert len(traces) == 2 and all("-sim-" in p.name for p in traces)
    with TraceReader(traces[-1]) as reader:
        assert reader.header.redacted and reader.closed_cleanly
    assert latest_trace() == traces[-1]  # names sort by start time


def test_trace_names_sort_by_time(trace_dir: Path) -> None:
    start = 1_700_000_000 * 10**9
    stamps = [start + d for d in (0, 999_000_000, 1_000_000_000, 86_400 * 10**9)]
    names = [new_trace_path("run", t).name for t in stamps]
    assert names == sorted(names) and len(set(names)) == 4
    assert latest_trace(trace_dir) is None


def test_sim_no_trace_writes_nothing(trace_dir: Path) -> None:
    result = schedtop("sim", CASE, "--no-trace")
    assert result.exit_code == 0 and "trace:" not in result.stdout
    assert not trace_dir.exists()


def test_info_on_a_cut_trace_says_where(tmp_path: Path) -> None:
    path = tmp_path / "c.trace"
    schedtop("sim", CASE, "--trace", str(path))
    with TraceReader(path) as reader:
        middle = reader.index().step_offsets[20]
    cut = tmp_path / "cut.trace"
    cut.write_bytes(path.read_bytes()[: middle + 5])  # inside step 20's frame header
    result = schedtop("info", str(cut))
    assert result.exit_code == 0
    assert f"no: the tail is cut at byte {middle:,} (frame header cut" in result.stdout
    assert "steps     20 (0..19)" in result.stdout
    cut.write_bytes(path.read_bytes()[:middle])  # as a writer still running leaves it
    result = schedtop("info", str(cut))
    assert "no: no footer (the writer is still running" in result.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        (b"just text\n", "not a schedtop trace"),
        (preamble(9, 1) + bytes(20), "trace format 9.1 is newer than this schedtop reads"),
        (preamble() + b"\x05\x00\x00\x00\x01\x00\x00\x00\x00abcde", "checksum mismatch"),
    ],
)
def test_info_errors_are_one_line_exit_2(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "bad.trace"
    if content is not None:
        path.write_bytes(content)
    result = schedtop("info", str(path))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"schedtop: error: {path}: ") and message in result.stderr


def test_sim_trace_into_a_missing_directory_is_a_user_error(tmp_path: Path) -> None:
    result = schedtop("sim", CASE, "--trace", str(tmp_path / "no" / "such" / "x.trace"))
    assert result.exit_code == 2
    assert "no directory" in result.stderr and "Traceback" not in result.stderr
