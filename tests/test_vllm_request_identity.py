"""Request identity across runs (issue 25, item 4): vLLM appends a random 8-hex suffix
to every request id; the client's id is what `diff`, `find`, breakpoints and the TUI
match on, so one workload recorded twice compares identical."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.test_vllm import fidelity_workloads, find_vllm_python, traces_in_vllm
from tui.cli import main as cli


@pytest.fixture(scope="module")
def twice(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    python = find_vllm_python()
    root = tmp_path_factory.mktemp("twice")
    w = fidelity_workloads()["e_priority_preemption"]
    runs = [
        {"name": name, "workload": w, "multiprocess": False, "async_scheduling": True}
        for name in ("a", "b")
    ]
    return traces_in_vllm(python, root, runs)


@pytest.mark.vllm
@pytest.mark.slow
def test_one_workload_recorded_twice_diffs_identical(twice: dict[str, Path]) -> None:
    res = CliRunner().invoke(cli, ["diff", str(twice["a"]), str(twice["b"])])
    assert res.exit_code == 0, res.output
    assert "identical" in res.output


@pytest.mark.vllm
@pytest.mark.slow
def test_find_and_breakpoints_take_the_clients_id(twice: dict[str, Path]) -> None:
    a, b = str(twice["a"]), str(twice["b"])
    steps = []
    for trace in (a, b):
        res = CliRunner().invoke(cli, ["find", trace, "admit:H", "--all", "--names"])
        assert res.exit_code == 0, res.output
        steps.append(res.stdout)
    assert steps[0] == steps[1] and steps[0].strip()  # the same step, in both runs
    # A client id the trace does not have is still refused.
    res = CliRunner().invoke(cli, ["find", a, "admit:nobody"])
    assert res.exit_code == 2 and "no request 'nobody'" in res.output


def test_client_ids() -> None:
    from recorder.ids import answers_to, client_id, names

    assert client_id("long1-0a1b2c3d") == "long1"
    assert client_id("chatcmpl-abc-0a1b2c3d") == "chatcmpl-abc"
    assert client_id("r0") == "r0" and client_id("r-0A1B2C3D") == "r-0A1B2C3D"
    assert names("long1-0a1b2c3d") == ("long1-0a1b2c3d", "long1")
    assert names("r0") == ("r0",)
    assert answers_to("long1-0a1b2c3d", "long1")
    assert answers_to("long1-0a1b2c3d", "long1-0a1b2c3d")
    assert not answers_to("long1-0a1b2c3d", "long")


def test_diff_matches_arrivals_by_client_id_only_across_vllm_runs() -> None:
    from engine.records import Arrival, SamplingParams, Step
    from replays.diff import differing_fields

    def arrival(rid: str, t: float) -> Arrival:
        return Arrival(0, rid, 8, 0, t, None, SamplingParams(max_tokens=4))

    a = Step(step=0, arrivals=(arrival("long1-0a1b2c3d", 1.5),))
    b = Step(step=0, arrivals=(arrival("long1-99999999", 7.25),))
    assert differing_fields(a, b) == ("arrivals",)
    assert differing_fields(a, b, across_runs=True) == ()
    c = Step(step=0, arrivals=(arrival("long2-99999999", 7.25),))
    assert differing_fields(a, c, across_runs=True) == ("arrivals",)
