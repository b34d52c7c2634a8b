"""Re-simulation reproduces every decision; what-if runs and diffs name the first
divergent step; stats agree with the engine's own counts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sim.api import demo_workload_path, load, run_sim
from engine.sim.workload import load_workload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from recorder.schema import Status
from replays.diff import diff_traces, format_diff
from replays.resim import ResimError, resimulate
from replays.stats import trace_stats
from tests.helpers import record, req, workload, write_trace

CASES = sorted((Path(__file__).parent / "data" / "fidelity").glob("*.workload.json"))


def recorded(path: Path, workload_path: Path | None = None, **options: object) -> Path:
    run_sim(load(workload_path), on_engine=lambda e: open_recording(e, path, live=False, **options))
    return path


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return recorded(tmp_path_factory.mktemp("resim") / "demo.trace")


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name.split(".")[0])
@pytest.mark.parametrize("scripted", [False, True])
def test_resim_reproduces_every_decision(case: Path, scripted: bool, tmp_path: Path) -> None:
    trace = recorded(tmp_path / "t.trace", case)
    result = resimulate(trace, scripted=scripted)
    assert result.reproduced, result.divergence
    assert result.num_steps == result.num_recorded_steps
    assert result.mode == ("scripted" if scripted else "faithful")


def test_resim_of_a_redacted_trace_replays_the_prefix_cache(tmp_path: Path) -> None:
    trace = recorded(tmp_path / "r.trace", demo_workload_path(), redact_prompts=True)
    result = resimulate(trace)
    assert result.reproduced and result.mode == "scripted"
    assert trace_stats(trace).prefix_hit_rate > 0


def test_resim_with_spec_decode_and_aborts(tmp_path: Path) -> None:
    w = workload(
        [req("a", 30, 40), req("b", 50, 30, arrival_step=1), req("c", 20, 20, arrival_step=2)],
        num_speculative_tokens=3,
        num_blocks=40,
    )
    run = record(w)
    trace = write_trace(tmp_path, run.data)
    assert resimulate(trace).reproduced
    assert resimulate(trace, scripted=True).reproduced


def test_a_changed_budget_names_the_first_divergent_step(demo_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "whatif.trace"
    result = resimulate(demo_trace, {"max_num_batched_tokens": 512}, out)
    assert result.divergence is not None
    d = diff_traces(demo_trace, out)
    assert d.first_step == result.divergence.step
    # Brute force: the first step whose scheduled entries differ.
    from recorder.reader import TraceReader
    from replays.timeline import Timeline

    with TraceReader(demo_trace) as ra, TraceReader(out) as rb:
        ta, tb = Timeline(ra), Timeline(rb)
        first = next(
            s
            for s in range(ta.num_steps)
            if [(e.ref, e.num_tokens) for e in ta.view(s).scheduled]
            != [(e.ref, e.num_tokens) for e in tb.view(s).scheduled]
        )
    assert d.first_step == first
    assert d.side_a is not None and d.side_b is not None
    assert d.side_a.scheduled != d.side_b.scheduled
    assert d.steps_differing > 0 and d.requests_affected
    text = format_diff(d)
    assert f"first difference at step {first}" in text and "preemptions" in text


def test_a_change_that_alters_nothing_is_reported_identical(tmp_path: Path) -> None:
    trace = recorded(tmp_path / "a.trace", CASES[0])
    out = tmp_path / "b.trace"
    result = resimulate(trace, {"max_num_seqs": 64}, out)
    assert result.divergence is None
    assert diff_traces(trace, out).identical


def test_stats_agree_with_the_engine(demo_trace: Path) -> None:
    s = trace_stats(demo_trace)
    w = load_workload(demo_workload_path())
    summary = run_sim(w)
    assert s.num_steps == summary.num_steps
    assert s.preemptions == summary.num_preemptions
    assert s.num_requests == len(w.requests) == s.num_finished
    assert s.output_tokens == sum(r.max_tokens for r in w.requests)
    assert s.unit == "steps" and s.ttft_p50 is not None and s.tpot_p99 is not None
    for r in s.requests:
        assert r.first_token_step - r.arrival_step + 1 == r.ttft
        assert r.first_token_step == summary.first_token[r.request_id]


def test_bad_overrides_and_mid_run_traces_are_refused(demo_trace: Path) -> None:
    with pytest.raises(ResimError, match="max_num_seqs=0"):
        resimulate(demo_trace, {"max_num_seqs": 0})


def schedtop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True)


def test_cli_resim_diff_stats_find(demo_trace: Path, tmp_path: Path) -> None:
    out = schedtop("resim", str(demo_trace))
    assert out.returncode == 0 and "every decision reproduced" in out.stdout
    whatif = tmp_path / "w.trace"
    out = schedtop(
        "resim", str(demo_trace), "--set", "max_num_batched_tokens=512", "--trace", str(whatif)
    )
    assert out.returncode == 0 and "first difference at step" in out.stdout
    assert schedtop("diff", str(demo_trace), str(demo_trace)).returncode == 0
    assert schedtop("diff", str(demo_trace), str(whatif)).returncode == 1
    s = json.loads(schedtop("stats", str(demo_trace), "--json").stdout)
    assert s["num_steps"] == trace_stats(demo_trace).num_steps
    hits = schedtop("find", str(demo_trace), "preempt", "--all").stdout.split()
    assert hits and all(h.isdigit() for h in hits)


@pytest.mark.parametrize(
    "args",
    [
        ("diff", "nope.trace", "nope2.trace"),
        ("stats", "nope"),
        ("resim", "nope"),
        ("find", "nope", "preempt"),
        ("resim", "X", "--set", "bogus=1"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(args: tuple[str, ...], demo_trace: Path) -> None:
    args = tuple(str(demo_trace) if a == "X" else a for a in args)
    out = schedtop(*args)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_aborts_of_one_step_replay_in_the_recorded_order() -> None:
    """Recorded from vLLM (multiprocess, async): in one step a request that had just arrived
    was aborted before an older one. Aborts free blocks, so their order is a decision."""
    path = Path(__file__).parent / "data" / "vllm_abort_order.trace"
    with TraceReader(path) as reader:
        orders = [
            [f.ref for f in s.finishes if f.status == Status.FINISHED_ABORTED]
            for s in reader.steps()
        ]
    assert any(refs != sorted(refs) for refs in orders), "the case lost what it is about"
    result = resimulate(path)
    assert result.reproduced, result.divergence
