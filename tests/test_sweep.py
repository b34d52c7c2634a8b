"""Sweeps: every trace under every grid point, the same table whichever executor ran it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from engine.sim.api import load, run_sim
from recorder.recorder import open_recording
from replays.sweep import SweepError, parse_grid, plan, run_sweep, to_json
from replays.whatif import whatif
from tests.test_whatif import SIM_MODEL
from tui.cli import main

FIDELITY = Path(__file__).parent / "data" / "fidelity"
CASES = ("b_four_1000_prompts", "c_kv_pressure_prefix", "e_priority_preemption")
MODEL = "intercept=0.004,prefill_tokens=2e-5,decode_requests=1e-4,context_tokens=1e-7"
GRID = ("--grid", "max_num_batched_tokens=256,3000", "--grid", "num_blocks=30,999")


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sweep")
    for case in CASES:
        path = d / f"{case}.trace"
        w = load(FIDELITY / f"{case}.workload.json")
        run_sim(w, on_engine=lambda e, p=path: open_recording(e, p, live=False))
    return d


def test_grid_parsing() -> None:
    assert parse_grid(["max_num_seqs=2,4,4", "enable_prefix_caching=on,off"]) == [
        ("max_num_seqs", [2, 4]),
        ("enable_prefix_caching", [True, False]),
    ]
    with pytest.raises(SweepError, match="unknown config key 'budget'"):
        parse_grid(["budget=1,2"])
    with pytest.raises(SweepError, match="expected KEY=V1,V2"):
        parse_grid(["max_num_seqs"])
    with pytest.raises(SweepError, match="given twice"):
        parse_grid(["max_num_seqs=1", "max_num_seqs=2"])


def test_every_trace_under_every_config_same_rows_serial_and_pool(traces: Path) -> None:
    grid = parse_grid(["max_num_batched_tokens=256,3000", "num_blocks=30,999"])
    paths = sorted(str(p) for p in traces.glob("*.trace"))
    tasks = plan(paths, grid, SIM_MODEL)
    # 3 traces x 4 grid points, plus each trace's recorded config as its baseline
    assert len(tasks) == 3 * 5 and sum(t.recorded for t in tasks) == 3
    serial = run_sweep(tasks, "serial")
    pooled = run_sweep(tasks, "pool", jobs=2)
    assert to_json(serial, "ttft_p99") == to_json(pooled, "ttft_p99")
    assert all(r.error is None for r in serial)
    # each row is the what-if of its trace under its config
    row = serial[3]
    direct = whatif(row.trace, row.config, SIM_MODEL)
    assert row.metrics == direct.predicted.to_json()


def test_sweep_cli_table_json_csv(traces: Path) -> None:
    res = schedtop("sweep", str(traces), *GRID, "--model", MODEL, "-j", "2")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].split()[:3] == ["trace", "config", "ttft_p99"]
    assert sum("(recorded) *" in line for line in lines) == 3
    assert "configs by mean ttft_p99 over traces:" in res.output
    rows = json.loads(schedtop("sweep", str(traces), *GRID, "--model", MODEL, "--json").output)
    assert len(rows) == 15
    for name in CASES:  # grouped by trace, best objective first
        own = [r["metrics"]["ttft_p99"] for r in rows if Path(r["trace"]).stem == name]
        known = [v for v in own if v is not None]  # None: no request got a token
        assert own[: len(known)] == sorted(known)
    csv = schedtop("sweep", str(traces), *GRID, "--model", MODEL, "--csv").output
    assert csv.splitlines()[0].startswith("trace,config,recorded,throughput")
    assert len(csv.splitlines()) == 16
    best = schedtop("sweep", str(traces), *GRID, "--model", MODEL, "--objective", "throughput")
    assert best.exit_code == 0
    bad = schedtop("sweep", str(traces), *GRID, "--model", MODEL, "--objective", "speed")
    assert bad.exit_code == 2 and "--objective 'speed'" in bad.output


def test_a_failing_task_names_its_trace_and_config_and_the_others_finish(
    traces: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "broken.trace"
    bad.write_bytes(b"not a trace at all")
    good = traces / f"{CASES[0]}.trace"
    res = schedtop("sweep", str(good), str(bad), "--grid", "max_num_seqs=4,8", "--model", MODEL)
    assert res.exit_code == 1
    assert "schedtop: task failed: " + str(bad) in res.output
    assert "{'max_num_seqs': 4}" in res.output and "{'max_num_seqs': 8}" in res.output
    table = [line for line in res.output.splitlines() if line.startswith(good.name)]
    assert len(table) == 3 and not any("error" in line for line in table)


@pytest.mark.slow
def test_ray_gives_the_same_table_as_the_process_pool(traces: Path) -> None:
    """A local Ray cluster, started by the sweep process and stopped when it exits."""
    args = ["sweep", str(traces), *GRID, "--model", MODEL, "--json", "-j", "2"]
    env = dict(os.environ, RAY_ADDRESS="", RAY_USAGE_STATS_ENABLED="0")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "tui.cli", *args]
    pool = subprocess.run(cmd, env=env, capture_output=True, timeout=300)
    ray = subprocess.run([*cmd, "--ray"], env=env, capture_output=True, timeout=300)
    assert pool.returncode == 0, pool.stderr.decode()
    assert ray.returncode == 0, ray.stderr.decode()
    assert json.loads(ray.stdout) == json.loads(pool.stdout)
    assert len(json.loads(ray.stdout)) == 15


def test_a_grid_point_equal_to_the_recorded_config_is_marked(traces: Path) -> None:
    # c_kv_pressure_prefix ran with a budget of 256 and 10 blocks
    trace = str(traces / "c_kv_pressure_prefix.trace")
    tasks = plan([trace], parse_grid(["max_num_batched_tokens=256,512", "num_blocks=10"]), None)
    assert [t.recorded for t in tasks] == [True, False]
