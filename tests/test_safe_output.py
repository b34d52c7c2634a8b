"""Issue 14, class 1 (silent data loss): every file a command writes goes through one set of
rules (engine.safe_output), and a trace being written is locked against a second writer.
Real files and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from recorder.reader import TraceReader
from tui.cli import main

FIDELITY = Path(__file__).parent / "data" / "fidelity"
CASE = FIDELITY / "c_kv_pressure_prefix.workload.json"


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def refused(result: Result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.count("\n") == 1, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr


def test_a_second_writer_on_a_trace_refuses_naming_the_path_and_the_first_pid(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.trace"
    cmd = [sys.executable, "-m", "tui.cli", "sim", str(CASE), "--trace", str(path)]
    first = subprocess.Popen([*cmd, "--pace", "10"], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (path.exists() and path.stat().st_size > 200):
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        second = subprocess.run(
            [*cmd, "--force"], capture_output=True, text=True, timeout=120, check=False
        )
        assert second.returncode == 2, second.stderr
        assert str(path) in second.stderr and f"pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    with TraceReader(path) as reader:
        steps = [e for e in reader.entries() if type(e.record).__name__ == "Step"]
        assert reader.footer is not None and len(steps) == reader.footer.num_steps == 56


def test_an_output_naming_an_input_is_refused_before_any_work(tmp_path: Path) -> None:
    workload = tmp_path / "w.json"
    workload.write_bytes(CASE.read_bytes())
    before = workload.read_bytes()
    refused(schedtop("sim", str(workload), "--trace", str(workload), "--force"), "is the input")
    refused(schedtop("sim", str(workload), "--decisions", str(workload), "--force"), "input")
    link = tmp_path / "alias.json"
    link.symlink_to(workload)
    refused(schedtop("sim", str(workload), "--decisions", str(link), "--force"), "input")
    assert workload.read_bytes() == before
    trace = tmp_path / "t.trace"
    assert schedtop("sim", str(workload), "--trace", str(trace)).exit_code == 0
    size = trace.stat().st_size
    refused(schedtop("resim", str(trace), "--trace", str(trace), "--force"), "is the input")
    refused(schedtop("export", str(trace), "--perfetto", str(trace), "--force"), "input")
    assert trace.stat().st_size == size
    with TraceReader(trace) as r:
        assert r.footer is not None and r.footer.num_steps == 56
    same = tmp_path / "same.out"
    refused(
        schedtop("sim", str(workload), "--trace", str(same), "--decisions", str(same)),
        "is also --trace",
    )
    assert not same.exists()


def test_existing_files_devices_links_and_empty_paths(tmp_path: Path) -> None:
    existing = tmp_path / "d.jsonl"
    existing.write_text("keep me\n")
    refused(schedtop("sim", str(CASE), "--decisions", str(existing)), "--force")
    assert existing.read_text() == "keep me\n"
    ok = schedtop("sim", str(CASE), "--no-trace", "--decisions", str(existing), "--force")
    assert ok.exit_code == 0 and existing.read_text().startswith("{")

    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "nowhere" / "x")
    refused(schedtop("sim", str(CASE), "--decisions", str(dangling), "--force"), "dangling")
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(schedtop("sim", str(CASE), "--decisions", str(fifo), "--force"), "not a regular")
    refused(schedtop("sim", str(CASE), "--trace", "/dev/null", "--force"), "not a regular")
    refused(schedtop("sim", str(CASE), "--decisions", ""), "empty path")

    # --force through a link to a regular file replaces the target, and the link stays
    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    ok = schedtop("sim", str(CASE), "--no-trace", "--decisions", str(link), "--force")
    assert ok.exit_code == 0 and link.is_symlink() and target.read_text().startswith("{")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("flag", ["--outputs", "--trace"])
def test_run_refuses_bad_outputs_before_loading_the_model(tmp_path: Path, flag: str) -> None:
    workload = tmp_path / "w.json"
    workload.write_text('{"requests": [{"id": "a", "prompt": "hi", "max_tokens": 2}]}')
    # a model path that does not exist: the output check must fail first
    refused(
        schedtop(
            "run",
            "--model",
            str(tmp_path / "no.gguf"),
            "--workload",
            str(workload),
            flag,
            str(workload),
        ),
        "is the input",
    )
    refused(schedtop("run", "--model", str(tmp_path / "no.gguf"), flag, ""), "empty path")
