"""`schedtop info/stats/replay DIR` over a directory of one data-parallel recording's rank
traces: the ranks side by side, each column equal to that rank's own output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from engine.sim.driver import make_engine, run_steps
from recorder.recorder import Recorder, RecorderOptions
from recorder.writer import MemoryWriter
from tests.helpers import req, workload
from tests.tui_support import START_NS, FakeClock
from tui import launch
from tui.cli import main

ENGINE = "vLLM 0.33.0 (Scheduler, DP rank {} of {})"


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def rank_trace(path: Path, rank: int | None, size: int = 2, **config: Any) -> Path:
    """A trace as a vLLM rank's engine core writes it: the rank in the header's engine
    (None: a header without it, the rank only in the file name)."""
    # Different work per rank, so that a column taken from the wrong rank shows.
    n = 3 + 2 * (rank or 0)
    w = workload(
        [req(f"r{rank}-{i}", 40 + 30 * i, max_tokens=20 + i, arrival_step=i) for i in range(n)],
        num_blocks=16 if rank == 1 else 1000,  # rank 1 preempts; a rank sizes its own pool
        **config,
    )
    name = ENGINE.format(rank, size) if rank is not None else "vLLM 0.33.0 (Scheduler)"
    # Fixed clocks (as tests.tui_support.fixed_trace): the engine's and the recorder's
    # agree, so the latencies are the steps' and the same every run.
    engine = make_engine(w)
    engine.clock = FakeClock(seconds=True)
    # The header names vLLM's rank, as the tap inside vLLM's scheduler describes itself.
    engine.describe = lambda: (name, "m")  # type: ignore[method-assign]
    options = RecorderOptions(
        strict=True, clock=FakeClock(seconds=False), wall_clock=lambda: START_NS
    )
    recorder = Recorder(engine, MemoryWriter(), options)
    for _ in run_steps(w, engine):
        pass
    engine.close()
    data = bytes(recorder.sink.data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def ranks(tmp_path: Path) -> Path:
    d = tmp_path / "rec"
    rank_trace(d / "20261202-010000.001-vllm-host-100-dp0.trace", 0)
    # rank 1 rotated: a run directory of segments (one here)
    rank_trace(d / "20261202-010000.002-vllm_dp1-101" / "segment-000000.trace", 1)
    return d


def test_stats_side_by_side_equal_each_ranks_own(ranks: Path) -> None:
    result = schedtop("stats", str(ranks), "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert [r["rank"] for r in got["ranks"]] == [0, 1] and got["missing_ranks"] == []
    for r in got["ranks"]:
        own = schedtop("stats", r["trace"], "--json")
        assert own.exit_code == 0, own.output
        assert r["stats"] == json.loads(own.stdout)
    a, b = (r["stats"] for r in got["ranks"])
    assert a["num_requests"] == 3 and b["num_requests"] == 5 and b["preemptions"] > 0

    text = schedtop("stats", str(ranks))
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["rank", "0", "rank", "1"]
    row = {line.split("  ")[0].strip(): line.split() for line in lines}
    assert row["requests"][-2:] == ["3", "5"]
    assert row["preemptions"][-2:] == ["0", str(b["preemptions"])]
    assert a["unit"] == "s"  # recorded on the clock: milliseconds, as `stats RANK` prints
    assert row["TTFT p99"][-4:] == [
        f"{a['ttft_p99'] * 1e3:.1f}",
        "ms",
        f"{b['ttft_p99'] * 1e3:.1f}",
        "ms",
    ]


def test_info_side_by_side(ranks: Path) -> None:
    result = schedtop("info", str(ranks))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("engine    vLLM 0.33.0 (Scheduler)  model: m\n")
    assert "vllm_dp1-101" in out and "dp0.trace" in out
    row = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    assert row["requests"][-2:] == ["3", "5"]
    assert row["closed"][-2:] == ["yes", "yes"]
    single = schedtop("info", str(ranks / "20261202-010000.001-vllm-host-100-dp0.trace"))
    assert "requests  3 arrived, 3 finished  preemptions 0" in single.stdout


def test_rank_from_the_file_name_and_a_missing_rank(tmp_path: Path) -> None:
    d = tmp_path / "rec"
    rank_trace(d / "a-vllm-host-1-dp0.trace", None)
    rank_trace(d / "a-vllm-host-2-dp2.trace", 2, size=3)
    result = schedtop("stats", str(d))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].split() == ["rank", "0", "rank", "2"]
    assert "missing ranks: 1 (no trace in this directory)" in result.stdout


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["info", "stats", "replay"])
def test_a_directory_mixing_recordings_is_refused(ranks: Path, command: str) -> None:
    rank_trace(ranks / "b-vllm-host-9-dp0.trace", 0)  # rank 0 of another run
    line = one_line_error(schedtop(command, str(ranks)))
    assert "mixes unrelated recordings: rank 0 twice" in line


def test_other_recordings_are_refused_by_what_differs(tmp_path: Path) -> None:
    d = tmp_path / "rec"
    rank_trace(d / "a-dp0.trace", 0)
    rank_trace(d / "b-dp1.trace", 1, max_num_seqs=8)
    assert "b-dp1.trace has another configuration than a-dp0.trace" in one_line_error(
        schedtop("info", str(d))
    )
    (d / "b-dp1.trace").unlink()
    rank_trace(d / "b-dp1.trace", 1, size=4)
    assert "another data-parallel size" in one_line_error(schedtop("stats", str(d)))
    (d / "b-dp1.trace").unlink()
    rank_trace(d / "plain.trace", None)  # not a rank at all
    line = one_line_error(schedtop("stats", str(d)))
    assert "plain.trace is not a data-parallel rank" in line


def test_stats_group_by_takes_one_rank(ranks: Path) -> None:
    from click.testing import CliRunner

    from tui.cli import main

    res = CliRunner().invoke(main, ["stats", str(ranks), "--group-by", "prio"])
    assert res.exit_code == 2 and "--group-by takes one trace" in res.output


def test_stats_cost_model_takes_one_rank(ranks: Path) -> None:
    result = schedtop("stats", str(ranks), "--cost-model")
    assert result.exit_code == 2 and "give one rank's trace" in result.output


def test_replay_opens_the_first_rank_and_names_the_others(
    ranks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[Any] = []

    def fake_run_app(session: Any) -> None:  # no terminal in tests: keep what it would show
        shown.append((session.name, list(session.notices)))
        session.close()

    monkeypatch.setattr(launch, "run_app", fake_run_app)
    assert schedtop("replay", str(ranks)).exit_code == 0
    name, notices = shown[-1]
    assert name.endswith("-dp0.trace")
    assert notices == [
        (
            "information",
            f"data-parallel rank 0 of {ranks}; the other ranks: 1 "
            f"(20261202-010000.002-vllm_dp1-101). Open one with: schedtop replay {ranks} --rank R",
        )
    ]
    assert schedtop("replay", str(ranks), "--rank", "1").exit_code == 0
    assert shown[-1][0] == "20261202-010000.002-vllm_dp1-101"
    line = one_line_error(schedtop("replay", str(ranks), "--rank", "5"))
    assert "--rank 5: no such rank in this directory (it has 0, 1)" in line
    single = ranks / "20261202-010000.001-vllm-host-100-dp0.trace"
    assert "only for a directory of data-parallel rank traces" in (
        schedtop("replay", str(single), "--rank", "0").output
    )


def test_real_vllm_traces_named_as_ranks(tmp_path: Path) -> None:
    """Traces vLLM's own engine loop recorded (tests/data): a rank from the -dpR name when
    the header has none; a directory joining two different set-ups is refused."""
    data = Path(__file__).parent / "data"
    trailing = data / "vllm_async_trailing_steps.trace"
    d = tmp_path / "same"
    d.mkdir()
    for rank in (0, 1):
        (d / f"20261201-203243.000-vllm-vm-{rank + 7}-dp{rank}.trace").write_bytes(
            trailing.read_bytes()
        )
    result = schedtop("stats", str(d), "--json")
    assert result.exit_code == 0, result.output
    own = json.loads(schedtop("stats", str(trailing), "--json").stdout)
    assert [r["stats"] for r in json.loads(result.stdout)["ranks"]] == [own, own]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a-dp0.trace").write_bytes(trailing.read_bytes())
    other = data / "vllm_async_prefix_caching_off_block32.trace"
    (mixed / "b-dp1.trace").write_bytes(other.read_bytes())
    line = one_line_error(schedtop("info", str(mixed)))
    assert line.endswith(
        "mixes unrelated recordings: b-dp1.trace has another configuration than a-dp0.trace"
    )


@pytest.mark.vllm
def test_a_real_vllm_data_parallel_recording(tmp_path: Path) -> None:
    """vLLM with data_parallel_size=2 (a dense model: vLLM runs the ranks as independent
    engines, each told DP=1): each rank still names itself, and the directory reads side
    by side with each column equal to its file's own stats."""
    import subprocess

    from tests.test_vllm import ROOT, find_vllm_python, vllm_env

    out = tmp_path / "rec"
    out.mkdir()
    proc = subprocess.run(
        [find_vllm_python(), "-m", "tests.vllm_dp", str(out)],
        cwd=ROOT,
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert sorted(n[-10:] for n in names) == ["-dp0.trace", "-dp1.trace"], names
    result = schedtop("stats", str(out), "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert [r["rank"] for r in got["ranks"]] == [0, 1]
    for r in got["ranks"]:
        assert r["stats"] == json.loads(schedtop("stats", r["trace"], "--json").stdout)
    assert sum(r["stats"]["num_requests"] for r in got["ranks"]) == 8
    info = schedtop("info", str(out))
    assert info.exit_code == 0 and "engine    vLLM 0.33" in info.stdout, info.output
