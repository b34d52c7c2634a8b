"""The pytest plugin: recorded traces as regression tests in a user's own CI."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from engine.sim.api import run_sim
from engine.sim.workload import load_workload
from recorder.recorder import open_recording

pytest_plugins = ["pytester"]

CASES = Path(__file__).parent / "data" / "fidelity"

USER_TEST = """
def test_incidents_still_decide_the_same(schedtop_resim):
    checked = schedtop_resim()
    assert checked
"""


@pytest.fixture
def traces(tmp_path: Path) -> Path:
    directory = tmp_path / "incidents"
    directory.mkdir()
    for case in ("c_kv_pressure_prefix", "e_priority_preemption"):
        workload = load_workload(CASES / f"{case}.workload.json")
        trace = directory / f"{case}.trace"
        run_sim(workload, on_engine=lambda e, t=trace: open_recording(e, t, live=False))
    return directory


def installed() -> bool:
    """Whether the `pytest11` entry point is installed (setup.sh's install makes it)."""
    return any(ep.name == "schedtop" for ep in entry_points(group="pytest11"))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(USER_TEST)
    # Through the entry point where the package is installed with it; else (a checkout
    # whose install predates the entry point) load the module by name.
    load = () if installed() else ("-p", "replays.pytest_plugin")
    return pytester.runpytest_subprocess(*load, *args)


def test_every_trace_reproduces(pytester: pytest.Pytester, traces: Path) -> None:
    result = run(pytester, "--schedtop-traces", str(traces), "-v")
    # One test per trace, named by its file.
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "test_incidents_still_decide_the_same[c_kv_pressure_prefix.trace] PASSED" in out
    assert "test_incidents_still_decide_the_same[e_priority_preemption.trace] PASSED" in out


def test_one_failing_trace_hides_no_other(pytester: pytest.Pytester, traces: Path) -> None:
    # A trace that is not a trace fails its own test; the good one still passes.
    (traces / "a_broken.trace").write_bytes(b"not a trace")
    result = run(pytester, "--schedtop-traces", str(traces), "-v")
    result.assert_outcomes(passed=2, failed=1)
    assert "[a_broken.trace] FAILED" in result.stdout.str()


def test_a_changed_config_fails_naming_the_step(pytester: pytest.Pytester, traces: Path) -> None:
    result = run(pytester, "--schedtop-traces", str(traces), "--schedtop-set", "num_blocks=9")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert (
        "c_kv_pressure_prefix.trace: re-simulated with schedtop's scheduler and num_blocks=9" in out
    )
    assert "decisions differ from step" in out
    # Formatted like `schedtop diff`: the first difference, both sides, then the metrics.
    assert "first difference at step" in out
    assert "A scheduled" in out and "B scheduled" in out
    assert "prefix-hit rate" in out


def test_without_a_directory_the_fixture_skips(pytester: pytest.Pytester) -> None:
    result = run(pytester)
    result.assert_outcomes(skipped=1)


def test_a_missing_directory_is_a_clear_failure(pytester: pytest.Pytester, tmp_path: Path) -> None:
    result = run(pytester, "--schedtop-traces", str(tmp_path / "nope"))
    result.assert_outcomes(failed=1)
    assert "no such file or directory" in result.stdout.str()


def test_a_bad_setting_is_a_usage_error(pytester: pytest.Pytester, traces: Path) -> None:
    result = run(pytester, "--schedtop-traces", str(traces), "--schedtop-set", "nonsense=1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    out = result.stdout.str() + result.stderr.str()
    assert "ERROR: --schedtop-set 'nonsense=1': unknown config key 'nonsense'" in out
    assert "Traceback" not in out
