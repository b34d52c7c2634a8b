"""What-if in time: the step-time model, the time-driven re-simulation and its table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner, Result

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import Timing
from engine.request import Request, SamplingParams
from engine.sim.api import demo_workload_path, load, run_sim
from engine.sim.runner import SimRunner
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions, open_recording
from recorder.schema import Step
from recorder.writer import TraceWriter
from replays.costmodel import (
    FEATURES,
    CostModel,
    CostModelError,
    fit_model,
    parse_model,
    step_work,
)
from replays.stats import trace_stats
from replays.timebase import fit_trace
from replays.timeline import Timeline
from replays.whatif import METRICS, WhatifError, whatif
from tests.helpers import record, req, workload, write_trace
from tui.cli import main

FIDELITY = sorted((Path(__file__).parent / "data" / "fidelity").glob("*.workload.json"))
SIM_MODEL = CostModel(
    0.004, {"prefill_tokens": 2e-5, "decode_requests": 1e-4, "context_tokens": 1e-7}
)


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def sim_trace(path: Path, workload_path: Path | None = None) -> Path:
    run_sim(load(workload_path), on_engine=lambda e: open_recording(e, path, live=False))
    return path


def step_ends(path: Path) -> list[int]:
    with TraceReader(path) as r:
        return [e.record.time_ns for e in r.entries() if isinstance(e.record, Step)]


# -- the model --------------------------------------------------------------------------------


def test_step_work_counts_prefill_decode_spec_and_context() -> None:
    # a 100-token prefill chunk after 28 cached, a decode at 40, a decode verifying 3 drafts
    assert step_work([(100, 0, 28), (1, 0, 40), (4, 3, 50)]) == (100, 2, 3, 128 + 41 + 54, 3)
    assert step_work([]) == (0, 0, 0, 0, 0)


def test_fit_recovers_a_linear_model_and_drops_an_outlier() -> None:
    rng = np.random.default_rng(0)
    work = rng.integers(0, 400, size=(200, 5))
    work[:, 2] = 0  # no speculative decoding: its coefficient stays 0
    truth = np.array([0.01, 2e-4, 1e-3, 0.0, 1e-6, 5e-4])
    secs = truth[0] + work @ truth[1:]
    secs[17] *= 8  # another process stole the CPU for one step
    m = fit_model(work, secs, "synthetic")
    assert m.fit is not None and m.fit.num_outliers == 1 and m.fit.r2 > 0.999999
    assert m.vector == pytest.approx(tuple(truth), rel=1e-6, abs=1e-12)
    assert m.predict_ns((100, 3, 0, 500, 4)) == round(
        (0.01 + 100 * 2e-4 + 3e-3 + 500e-6 + 4 * 5e-4) * 1e9
    )


def test_fit_never_gives_work_a_negative_cost() -> None:
    # num_requests = decode_requests + 1 always: collinear; plain least squares would
    # happily trade a positive term for a negative one
    rng = np.random.default_rng(1)
    d = rng.integers(1, 64, size=100)
    work = np.stack([np.full(100, 32), d, np.zeros(100), d * 100, d + 1], axis=1)
    secs = 0.02 + 0.003 * d + rng.normal(0, 1e-4, 100)
    m = fit_model(work, secs, "collinear")
    assert all(v >= 0 for v in m.coefficients.values())
    assert m.predict_ns((32, 10, 0, 1000, 11)) == pytest.approx(0.05e9, rel=0.02)


def test_model_spec_and_file_round_trip(tmp_path: Path) -> None:
    m = parse_model("intercept=0.004, prefill_tokens=2e-5,decode_requests=1e-4")
    assert m.intercept_s == 0.004 and m.coefficients["decode_requests"] == 1e-4
    f = tmp_path / "m.json"
    f.write_text(json.dumps(m.to_json()))
    assert parse_model(str(f)) == m
    with pytest.raises(CostModelError, match="unknown feature.*prefil_tokens"):
        parse_model("prefil_tokens=1e-5")
    with pytest.raises(CostModelError, match="'x' is not a number"):
        parse_model("intercept=x")
    with pytest.raises(CostModelError, match="neither a file"):
        parse_model(str(tmp_path / "missing.json"))
    f.write_text("{not json")
    with pytest.raises(CostModelError, match="not a cost model file"):
        parse_model(str(f))


# -- a simulated trace with a given model ---------------------------------------------------------


@pytest.mark.parametrize("case", FIDELITY, ids=lambda p: p.name.split(".")[0])
def test_whatif_without_changes_reproduces_a_sim_trace(case: Path, tmp_path: Path) -> None:
    trace = sim_trace(tmp_path / "t.trace", case)
    out = tmp_path / "p.trace"
    r = whatif(trace, None, SIM_MODEL, out)
    assert r.first_difference is None
    assert r.predicted == r.recorded
    # every predicted step took exactly what the model says of the recorded step's work
    ends = step_ends(out)
    assert len(ends) == len(step_ends(trace))
    assert schedtop("diff", str(trace), str(out)).exit_code == 0


def test_whatif_aborts_one_steps_requests_in_the_recorded_order() -> None:
    """vLLM aborted a request that had just arrived before an older one in one step; the
    prediction must too (aborts free blocks), as re-simulation does."""
    trace = Path(__file__).parent / "data" / "vllm_abort_order.trace"
    r = whatif(trace, None, SIM_MODEL, None)
    assert r.first_difference is None


def test_whatif_reproduces_spec_decoding_and_idle_gaps(tmp_path: Path) -> None:
    w = workload(
        [req("a", 30, 40), req("b", 50, 30, arrival_step=1), req("c", 20, 20, arrival_step=90)],
        num_speculative_tokens=3,
        num_blocks=40,
    )
    trace = write_trace(tmp_path, record(w).data)
    r = whatif(trace, None, SIM_MODEL, tmp_path / "p.trace")
    assert r.first_difference is None and r.predicted == r.recorded
    assert r.predicted.num_steps == len(step_ends(trace)) > 90  # the empty steps are kept


def test_whatif_with_a_smaller_budget_predicts_a_slower_first_token(tmp_path: Path) -> None:
    trace = sim_trace(tmp_path / "demo.trace", demo_workload_path())
    out = tmp_path / "p.trace"
    r = whatif(trace, {"max_num_batched_tokens": 64}, SIM_MODEL, out)
    assert r.first_difference is not None
    assert r.predicted.ttft_p99 is not None and r.recorded.ttft_p99 is not None
    assert r.predicted.ttft_p99 > r.recorded.ttft_p99
    assert r.predicted.num_requests == r.recorded.num_requests
    assert r.predicted.output_tokens == r.recorded.output_tokens
    # the predicted trace is a timed trace like any other: stats measures it in seconds
    s = trace_stats(out)
    assert s.unit == "s" and s.output_tokens == r.predicted.output_tokens
    assert s.duration_s == pytest.approx(step_ends(out)[-1] / 1e9)
    assert schedtop("diff", str(trace), str(out)).exit_code == 1
    # ... and the debugger and the exporter read it like any trace
    with TraceReader(out) as reader:
        tl = Timeline(reader)
        assert not tl.state(tl.last_step).requests  # every request finished
        assert tl.time_ns(tl.last_step) == step_ends(out)[-1]
    res = schedtop("export", str(out), "--perfetto", str(tmp_path / "p.json"))
    assert res.exit_code == 0, res.output


def test_whatif_reproduces_a_redacted_sim_trace(tmp_path: Path) -> None:
    trace = tmp_path / "r.trace"
    run_sim(
        load(demo_workload_path()),
        on_engine=lambda e: open_recording(e, trace, live=False, redact_prompts=True),
    )
    r = whatif(trace, None, SIM_MODEL)
    assert r.first_difference is None and r.predicted == r.recorded


def test_whatif_cli_table_and_errors(tmp_path: Path) -> None:
    trace = sim_trace(tmp_path / "demo.trace", demo_workload_path())
    spec = "intercept=0.004,prefill_tokens=2e-5,decode_requests=1e-4"
    res = schedtop("whatif", str(trace), "--model", spec, "--trace", str(tmp_path / "p.trace"))
    assert res.exit_code == 0, res.output
    assert "decisions: identical to the recording" in res.output
    for name in METRICS:
        assert name in res.output
    res = schedtop("whatif", str(trace), "--model", spec, "--set", "max_num_seqs=2", "--json")
    doc = json.loads(res.output)
    assert doc["changed"] == {"max_num_seqs": 2} and doc["first_difference"] is not None
    res = schedtop("whatif", str(trace))  # a sim trace has no timings to fit
    assert res.exit_code == 2 and "no step timings" in res.output and "--model" in res.output
    res = schedtop("whatif", str(trace), "--model", "intercept=0.01,foo=1")
    assert res.exit_code == 2 and "unknown feature(s) foo" in res.output
    res = schedtop("whatif", str(trace), "--model", spec, "--set", "max_num_seqs=0")
    assert res.exit_code == 2 and "max_num_seqs" in res.output


# -- a timed trace: fit, then predict the recording itself ---------------------------------


TRUE_MODEL = CostModel(0.015, {"prefill_tokens": 1.5e-4, "decode_requests": 2e-3})


class _ChargedRunner(SimRunner):
    """A scripted runner whose steps take what TRUE_MODEL says, on a fake clock."""

    def __init__(self, clock: list[int]) -> None:
        super().__init__({})
        self.clock = clock

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        before = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        before.update(
            zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens)
        )
        work = step_work((n, 0, before[r]) for r, n in out.num_scheduled_tokens.items())
        ns = TRUE_MODEL.predict_ns(work)
        self.clock[0] += ns
        result.timings = [Timing(out.step, 1_000_000, ns - 2_000_000, None, 1_000_000)]
        return result


def timed_trace(path: Path, budget: int = 256, num_blocks: int = 200) -> Path:
    """Like `schedtop run`: arrivals on the engine's clock (whose origin is not the
    recording's), added at the next step boundary; an idle engine waits for them."""
    clock = [0]
    origin = 7_000.0  # the engine clock's reading when the recording started
    runner = _ChargedRunner(clock)
    config = EngineConfig(
        max_num_batched_tokens=budget, max_num_seqs=8, num_blocks=num_blocks, block_size=16
    )
    engine = EngineCore(config, runner, clock=lambda: origin + clock[0] / 1e9)
    rec = Recorder(engine, TraceWriter(path, live=False), RecorderOptions(clock=lambda: clock[0]))
    hasher = BlockHasher(16)
    rng = np.random.default_rng(5)
    arrivals = [int(t * 1e9) for t in np.cumsum(rng.exponential(0.08, 30)) + 0.3]  # ns
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i] <= clock[0]:
            prompt = list(range(i * 1000, i * 1000 + int(rng.integers(20, 200))))
            out = list(range(3, 3 + int(rng.integers(4, 30))))
            runner.add_script(f"r{i}", out)
            engine.add_request(
                Request(
                    f"r{i}",
                    prompt,
                    SamplingParams(max_tokens=len(out)),
                    arrival_time=origin + arrivals[i] / 1e9,
                    block_hasher=hasher,
                )
            )
            i += 1
        if not engine.has_unfinished():
            clock[0] = arrivals[i]
            continue
        engine.step()
    rec.close()
    return path


def test_fit_on_a_timed_trace_recovers_its_step_times(tmp_path: Path) -> None:
    m = fit_trace(timed_trace(tmp_path / "t.trace"))
    assert m.fit is not None and m.fit.r2 > 0.9999 and m.fit.num_outliers == 0
    assert m.intercept_s == pytest.approx(0.015, rel=1e-3)
    assert m.coefficients["prefill_tokens"] == pytest.approx(1.5e-4, rel=1e-3)
    assert m.coefficients["decode_requests"] == pytest.approx(2e-3, rel=1e-3)
    res = schedtop("stats", str(tmp_path / "t.trace"), "--cost-model")
    assert res.exit_code == 0 and "R² 1.000" in res.output
    doc = json.loads(schedtop("stats", str(tmp_path / "t.trace"), "--cost-model", "--json").output)
    assert set(doc["coefficients"]) == set(FEATURES) and doc["fit"]["num_steps"] > 50


def test_whatif_self_check_on_a_timed_trace(tmp_path: Path) -> None:
    """Fitted on its own exact timings, the prediction of the recorded run is the run:
    arrivals land at the same step boundaries, so every decision and latency matches."""
    trace = timed_trace(tmp_path / "t.trace")
    r = whatif(trace)
    assert r.first_difference is None
    for name in METRICS:
        a, b = getattr(r.recorded, name), getattr(r.predicted, name)
        assert b == pytest.approx(a, rel=1e-6), name
    # against the recording's own stats, which measure from the step clock alone
    s = trace_stats(trace)
    assert r.recorded.output_tokens == s.output_tokens and r.recorded.preemptions == s.preemptions


def test_whatif_on_a_timed_trace_with_a_small_pool_predicts_preemptions(tmp_path: Path) -> None:
    trace = timed_trace(tmp_path / "t.trace")
    small = whatif(trace, {"num_blocks": 30})
    assert small.recorded.preemptions == 0 and small.predicted.preemptions > 0
    assert small.predicted.recompute_tokens > 0
    assert small.predicted.peak_blocks <= 29


def test_whatif_refuses_a_trace_that_starts_mid_run(tmp_path: Path) -> None:
    w = workload([req("a", 40, 20), req("b", 40, 20)])
    from engine.sim.driver import make_engine, run_steps

    engine = make_engine(w)
    steps = run_steps(w, engine)
    next(steps)
    rec = Recorder(engine, TraceWriter(tmp_path / "mid.trace", live=False))
    for _ in steps:
        pass
    rec.close()
    with pytest.raises(WhatifError, match="starts mid-run"):
        whatif(tmp_path / "mid.trace", None, SIM_MODEL)
