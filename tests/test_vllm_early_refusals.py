"""Early, clear refusals (issue 25, item 8): a recording that cannot work is refused
before vLLM loads the model (the `vllm.general_plugins` entry point), and `resim --engine
vllm` neither overwrites a file nor drops its trace where an incident glob finds it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from recorder.vllm.plugin import early_problems, records
from tests.test_vllm import ROOT, find_vllm_python, vllm_env
from tui.cli import main as cli

# Aborts that land in one step re-simulate in hash-seed order until item 3 lands: a trace
# without them.
TRACE = ROOT / "tests" / "data" / "vllm_async_trailing_steps.trace"


def test_the_plugin_acts_only_when_recording_is_asked() -> None:
    assert records(["vllm", "serve", "m", "--scheduler-cls", "recorder.vllm.RecordingScheduler"])
    assert records(["vllm", "serve", "m", "--scheduler-cls=recorder.vllm.RecordingScheduler"])
    assert not records(["vllm", "serve", "m"])


def test_a_good_set_up_has_no_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHEDTOP_TRACE_FILE", raising=False)
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path / "new" / "traces"))
    assert early_problems("0.33.0") == []
    assert (tmp_path / "new" / "traces").is_dir()


def test_bad_directory_number_and_version_are_each_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.delenv("SCHEDTOP_TRACE_FILE", raising=False)
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path / "file" / "traces"))
    monkeypatch.setenv("SCHEDTOP_FLUSH_INTERVAL_S", "1s")
    problems = early_problems("0.34.0")
    assert len(problems) == 3, problems
    assert "this is vLLM 0.34.0" in problems[0]
    assert "SCHEDTOP_FLUSH_INTERVAL_S='1s': expected a number" in problems[1]
    assert "cannot create the trace directory" in problems[2]


def test_a_trace_file_in_a_missing_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHEDTOP_TRACE_FILE", str(tmp_path / "nope" / "t.trace"))
    assert early_problems("0.33.0") == [
        f"SCHEDTOP_TRACE_FILE={tmp_path / 'nope' / 't.trace'}: its directory does not exist"
    ]


def test_resim_vllm_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out.trace"
    out.write_bytes(b"keep me")
    result = CliRunner().invoke(cli, ["resim", str(TRACE), "--engine", "vllm", "--trace", str(out)])
    assert result.exit_code == 2, result.output
    assert "exists; pass --force to overwrite it" in result.output
    assert out.read_bytes() == b"keep me"


def _plugin_on_path(tmp_path: Path) -> Path:
    """A dist-info that registers this checkout's entry point for vLLM, whichever schedtop
    the vLLM venv has installed (the check must not depend on reinstalling it)."""
    site = tmp_path / "site"
    info = site / "schedtop_early_check-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: schedtop-early-check\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nschedtop = recorder.vllm.plugin:check_early\n"
    )
    return site


@pytest.mark.vllm
def test_vllm_serve_refuses_a_bad_trace_dir_before_loading_the_model(tmp_path: Path) -> None:
    python = find_vllm_python()
    (tmp_path / "file").write_text("")
    env = vllm_env()
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = f"{ROOT}:{_plugin_on_path(tmp_path)}"
    env["SCHEDTOP_TRACE_DIR"] = str(tmp_path / "file" / "traces")
    proc = subprocess.run(
        [
            python,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(tmp_path / "no-such-model"),
            "--scheduler-cls",
            "recorder.vllm.RecordingScheduler",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    # Refused by the plugin, as vLLM builds its argument parser: the (missing) model
    # was not even looked at.
    assert last.startswith("schedtop: ") and "cannot create the trace directory" in last, last
    assert "before loading the model" in last
    assert "Traceback" not in proc.stderr
    assert "no-such-model" not in proc.stderr


@pytest.mark.vllm
@pytest.mark.slow
def test_resim_vllm_writes_a_new_file_in_the_trace_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCHEDTOP_VLLM_PYTHON", find_vllm_python())
    incidents = tmp_path / "incidents"
    incidents.mkdir()
    trace = incidents / "t.trace"
    trace.write_bytes(TRACE.read_bytes())
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path / "traces"))
    result = CliRunner().invoke(cli, ["resim", str(trace), "--engine", "vllm"])
    assert result.exit_code == 0, result.output
    # Nothing new next to the incident, where `pytest --schedtop-traces` would glob it.
    assert [p.name for p in incidents.iterdir()] == ["t.trace"]
    (made,) = (tmp_path / "traces").glob("*-resim-vllm-*.trace")
    assert f"trace: {made}" in result.output
