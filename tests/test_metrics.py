"""One truth for every number (issue 24): `run`'s and `sim`'s printed summaries, `stats
--json` and `whatif --json`'s "recorded" side come from one fold (engine.metrics) and
agree; a step's duration is its work, not the idle wait before it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from engine.metrics import Lifecycles, run_metrics, step_clock
from engine.records import Admission, Arrival, Finish, Preemption, SamplingParams, Scheduled, Step
from recorder.reader import TraceReader
from replays.breakpoints import find_all, parse
from replays.costmodel import TRUST_R2, CostModel, fit_model, parse_model, trust_warning
from replays.stats import trace_stats
from replays.sweep import SweepRow, format_table
from replays.timeline import Timeline
from replays.whatif import METRICS
from tests.model_support import needs_default_model, write_tiny_gguf
from tui.cli import main

FIGURES = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def _cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def _printed(out: str) -> dict[str, float]:
    """TTFT/TPOT p50/p99 as `run` prints them, in seconds."""
    m = re.search(
        r"engine TTFT p50 (\S+ m?s)  p99 (\S+ m?s)   TPOT p50 (\S+ m?s)  p99 (\S+ m?s)", out
    )
    assert m, out

    def secs(text: str) -> float:
        value, unit = text.split()
        return float(value) / (1000 if unit == "ms" else 1)

    return dict(zip(FIGURES, map(secs, m.groups())))


def _agree(a: float | None, b: float | None, rel: float = 0.01) -> bool:
    assert a is not None and b is not None
    return abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-4  # + the printed 0.1 ms


def _check_run_stats_whatif(out: str, trace: Path) -> None:
    printed = _printed(out)
    stats = json.loads(_cli("stats", str(trace), "--json"))
    recorded = json.loads(_cli("whatif", str(trace), "--json"))["recorded"]
    assert stats["unit"] == "s"
    for k in FIGURES:
        assert _agree(printed[k], stats[k]), (k, printed[k], stats[k])
        assert _agree(stats[k], recorded[k]), (k, stats[k], recorded[k])
    rate = re.search(r"prefix-hit rate (\S+)%", out)
    assert rate and abs(float(rate.group(1)) / 100 - stats["prefix_hit_rate"]) < 0.001


def _run_workload(tmp_path: Path, n: int, gap: float = 0.0) -> Path:
    path = tmp_path / "w.json"
    requests = [
        {
            "id": f"r{i}",
            "prompt": "the same system prompt for every request, " * 3 + f"question {i} " * i,
            "arrival_time": 0.01 * i + (gap if i >= n // 2 else 0.0),
            "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        }
        for i in range(n)
    ]
    path.write_text(json.dumps({"requests": requests}))
    return path


TINY = ["--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16"]
TINY += ["--num-gpu-blocks-override", "64", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_run_stats_and_whatif_agree_on_a_real_run(tiny_gguf: Path, tmp_path: Path) -> None:
    trace = tmp_path / "run.trace"
    w = _run_workload(tmp_path, 8)
    out = _cli("run", "--model", str(tiny_gguf), "--workload", str(w), *TINY, "--trace", str(trace))
    _check_run_stats_whatif(out, trace)


@pytest.mark.slow
@pytest.mark.model
@needs_default_model
def test_run_stats_and_whatif_agree_on_the_default_model(tmp_path: Path) -> None:
    trace = tmp_path / "run.trace"
    w = _run_workload(tmp_path, 6)
    limits = ["--max-num-batched-tokens", "64", "--max-num-seqs", "4"]
    out = _cli("run", "--workload", str(w), "--trace", str(trace), *limits)
    _check_run_stats_whatif(out, trace)


def test_sim_and_stats_agree_in_steps(tmp_path: Path) -> None:
    """The demo workload preempts and hits the prefix cache, also on re-admission."""
    trace = tmp_path / "sim.trace"
    out = _cli("sim", "--trace", str(trace))
    stats = json.loads(_cli("stats", str(trace), "--json"))
    assert stats["unit"] == "steps" and stats["preemptions"] > 0
    m = re.search(r"engine TTFT p50 (\S+)  p99 (\S+)   TPOT p50 (\S+)  p99 (\S+)", out)
    assert m, out
    for k, v in zip(FIGURES, m.groups()):
        assert float(v) == pytest.approx(stats[k], abs=0.005), k
    hits = re.search(r"prefix-hit rate (\S+)% \((\d+) of (\d+) tokens at first admissions", out)
    assert hits, out
    assert float(hits.group(1)) == pytest.approx(100 * stats["prefix_hit_rate"], abs=0.05)
    assert int(hits.group(2)) == stats["prefix_hit_tokens"]
    assert f"re-admissions {stats['readmit_hit_tokens']} of" in out
    assert f"preemptions {stats['preemptions']}" in out


def _arrival(ref: int, prompt: int) -> Arrival:
    return Arrival(ref, f"r{ref}", prompt, 0, float(ref), None, SamplingParams(max_tokens=4))


def test_hits_at_re_admission_are_counted_apart_from_first_admissions() -> None:
    fold = Lifecycles()
    e = Scheduled(0, 32, 0, 0)
    fold.step_explicit(
        Step(0, arrivals=(_arrival(0, 32),), scheduled=(e,), admissions=(Admission(0, 16, False),))
    )
    fold.step_explicit(Step(1, scheduled=(Scheduled(0, 1, 2, 32),)))
    fold.step_explicit(Step(2, preemptions=(Preemption(0, 0, 34),), sample_counts=()))
    again = Scheduled(0, 34, 0, 0)
    fold.step_explicit(Step(3, scheduled=(again,), admissions=(Admission(0, 32, True),)))
    fold.step_explicit(Step(4, scheduled=(Scheduled(0, 1, 2, 34),), finishes=(Finish(0, 4),)))
    m = run_metrics(fold, step_clock(fold))
    assert (m.prefix_hit_tokens, m.prefix_query_tokens) == (16, 32)
    assert (m.readmit_hit_tokens, m.readmit_query_tokens) == (32, 34)  # prompt + 2 outputs
    assert m.prefix_hit_rate == 0.5 and m.preemptions == 1 and m.recompute_tokens == 34
    # sampled at steps 0, 1, 3, 4: TTFT 1 step (its arrival step), TPOT (4 - 0) / 3
    assert m.ttft_p50 == 1.0 and m.tpot_p50 == pytest.approx(4 / 3)
    assert m.itl_p99 == pytest.approx(1.98) and m.e2e_p50 == 5.0


def test_a_run_with_an_idle_gap_has_no_step_longer_than_its_work(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "gap.trace"
    # The second wave comes 2 s after the first, which takes about 0.1 s (0.3 s on a loaded CI
    # machine), so the idle wait between them is over 1 s however slow the machine is.
    w = _run_workload(tmp_path, 4, gap=2.0)
    _cli("run", "--model", str(tiny_gguf), "--workload", str(w), *TINY, "--trace", str(trace))
    with TraceReader(trace) as reader:
        recs = list(reader.steps())
    prev = 0
    waits = []
    for rec in recs:
        assert rec.work_ns > 0
        assert rec.duration_ns(prev) == rec.work_ns
        waits.append(rec.idle_ns(prev))
        prev = rec.time_ns
    assert max(waits) > 1e9  # the gap is there, as idle
    assert max(r.work_ns for r in recs) < 1e9
    with TraceReader(trace) as reader:
        tl = Timeline(reader)
        assert list(find_all(tl, [parse("slow>1000")])) == []
    stats = trace_stats(trace)
    assert stats.idle_s > 1.0 and stats.work_s < stats.duration_s - 1.0
    export = tmp_path / "gap.json"
    _cli("export", str(trace), "--perfetto", str(export))
    events: list[dict[str, Any]] = json.loads(export.read_text())["traceEvents"]
    steps = [e for e in events if e.get("cat") == "step"]
    assert max(e["dur"] for e in steps) < 1e6  # µs
    assert max(e["dur"] for e in events if e.get("cat") == "idle") > 1e6


def test_the_fit_is_judged_on_steps_it_did_not_see() -> None:
    rng = np.random.default_rng(5)
    work = rng.integers(0, 500, size=(60, 5))
    work[:, 2] = 0
    exact = 0.002 + work @ np.array([2e-5, 1e-4, 0.0, 1e-7, 3e-5])
    good = fit_model(work, exact, "exact")
    assert good.fit is not None and good.fit.holdout_r2 == pytest.approx(1.0)
    assert good.fit.num_holdout == 12 and trust_warning(good) is None
    noise = fit_model(work, rng.uniform(0.01, 0.02, size=60), "noise")
    assert noise.fit is not None and noise.fit.trust_r2 < TRUST_R2
    assert "held-out R²" in (trust_warning(noise) or "")
    metrics = dict.fromkeys(METRICS, 1.0)
    rows = [SweepRow("a.trace", {"max_num_seqs": 4}, False, metrics, fit_r2=0.1)]
    table = format_table(rows, "ttft_p99")
    assert "max_num_seqs=4 ?" in table and f"held-out R² below {TRUST_R2}" in table


def test_the_engines_first_step_is_its_warm_up_not_a_step_to_fit() -> None:
    """Step 0 pays one-time costs: left out of the fit, its excess is charged once to a
    predicted run's first step, so that the requests that arrived during it join the same
    step as they did (the README's main job: every decision reproduced, docs/whatif.md)."""
    rng = np.random.default_rng(7)
    work = rng.integers(1, 500, size=(40, 5))
    work[:, 2] = 0
    secs = 0.002 + work @ np.array([2e-5, 1e-4, 0.0, 1e-7, 3e-5])
    secs[0] += 4.0  # the kernel's load, the weights' first touch
    m = fit_model(work, secs, "warm", warmup=True)
    assert m.warmup_s == pytest.approx(4.0) and m.fit is not None
    assert m.fit.num_excluded == 1 and m.fit.num_outliers == 0 and m.fit.r2 == pytest.approx(1.0)
    assert m.predict_ns(work[0], first=True) == pytest.approx(secs[0] * 1e9, rel=1e-6)
    assert m.predict_ns(work[0]) == pytest.approx((secs[0] - 4.0) * 1e9, rel=1e-6)
    assert fit_model(work, secs, "cold").warmup_s == 0.0
    again = CostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert again.warmup_s == m.warmup_s
    assert parse_model("intercept=0.01,warmup=2").warmup_s == 2.0


def test_a_predicted_run_ends_its_first_step_when_the_recording_did(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """The warm-up is measured from the arrival that woke the engine to the end of its
    first step (the tokenizer's first call and the kernel's load included): a predicted
    run, which starts its first step at that arrival, ends it where the recording did."""
    from replays.timebase import fit_trace
    from replays.whatif import whatif

    trace, predicted = tmp_path / "run.trace", tmp_path / "pred.trace"
    w = _run_workload(tmp_path, 4)
    _cli("run", "--model", str(tiny_gguf), "--workload", str(w), *TINY, "--trace", str(trace))
    whatif(trace, out=predicted, check=False)
    ends = []
    for path in (trace, predicted):
        with TraceReader(path) as reader:
            ends.append(next(iter(reader.steps())).time_ns)
    if fit_trace(trace).warmup_s > 0:
        assert abs(ends[1] - ends[0]) < 1_000_000, ends  # ns: the same end, to rounding
    else:  # a first step no slower than its work says: nothing to add
        assert ends[1] >= ends[0] - 1_000_000, ends


def test_whatif_refuses_a_model_below_min_r2(tiny_gguf: Path, tmp_path: Path) -> None:
    trace = tmp_path / "run.trace"
    w = _run_workload(tmp_path, 8)
    _cli("run", "--model", str(tiny_gguf), "--workload", str(w), *TINY, "--trace", str(trace))
    result = CliRunner().invoke(main, ["whatif", str(trace), "--min-r2", "1.0"])
    assert result.exit_code == 2 and "below --min-r2 1.0" in result.stderr
    shown = CliRunner().invoke(main, ["whatif", str(trace)])
    assert shown.exit_code == 0 and "held out: R²" in shown.stdout


def test_a_paced_sim_trace_counts_the_pacing_as_idle(tmp_path: Path) -> None:
    """`sim --pace` sleeps between steps: that wait is idle, not the steps' work."""
    trace = tmp_path / "paced.trace"
    case = Path(__file__).parent / "data" / "fidelity" / "a_decode_plus_arrival.workload.json"
    _cli("sim", str(case), "--pace", "10", "--trace", str(trace))  # 100 ms a step
    with TraceReader(trace) as reader:
        recs = list(reader.steps())
    prev = 0
    for rec in recs:
        assert 0 < rec.duration_ns(prev) == rec.work_ns < 50_000_000
        if rec.step:
            assert rec.idle_ns(prev) > 50_000_000
        prev = rec.time_ns
    with TraceReader(trace) as reader:
        assert list(find_all(Timeline(reader), [parse("slow>50")])) == []


def test_no_step_timings_says_why(tmp_path: Path) -> None:
    data = Path(__file__).parent / "data"
    sim = tmp_path / "sim.trace"
    _cli("sim", str(data / "fidelity" / "a_decode_plus_arrival.workload.json"), "--trace", str(sim))
    for trace, why in (
        (sim, "a simulated run"),
        (data / "vllm_abort_order.trace", "recorded by schedtop's plugin in vLLM"),
    ):
        for command in (["whatif", str(trace)], ["stats", str(trace), "--cost-model"]):
            res = CliRunner().invoke(main, command)
            assert res.exit_code == 2 and f"no step timings: {why}" in res.stderr, command


def test_the_servers_metrics_are_the_traces_stats(tmp_path: Path) -> None:
    """/metrics' latency histograms observe the fold (engine.metrics.LiveMetrics) on the
    engine's clock: their counts and sums are what `stats` reads from the server's trace."""
    import asyncio

    from tests.serve_support import metric
    from tests.test_serve_app import served

    trace = tmp_path / "serve.trace"

    async def go() -> str:
        async with served(trace, max_num_seqs=2) as (client, _):
            bodies = [
                {"prompt": f"request {i} " * (1 + i), "max_tokens": 3 + i, "ignore_eos": True}
                for i in range(5)
            ]
            bodies[0]["stream"] = True
            replies = await asyncio.gather(
                *(client.post("/v1/completions", json=b) for b in bodies)
            )
            assert all(r.status_code == 200 for r in replies)
            return (await client.get("/metrics")).text

    text = asyncio.run(go())
    stats = json.loads(_cli("stats", str(trace), "--json"))
    reqs = stats["requests"]
    assert stats["unit"] == "s" and len(reqs) == 5

    def hist(name: str) -> tuple[float, float]:
        return metric(text, f"vllm:{name}_count"), metric(text, f"vllm:{name}_sum")

    for name, key in (
        ("time_to_first_token_seconds", "ttft"),
        ("e2e_request_latency_seconds", "e2e"),
        ("request_queue_time_seconds", "queue"),
        ("request_time_per_output_token_seconds", "tpot"),
    ):
        values = [r[key] for r in reqs if r[key] is not None]
        count, total = hist(name)
        assert count == len(values) == 5, name
        assert total == pytest.approx(sum(values), rel=0.01, abs=1e-4), name
    # every token after a request's first is one gap; together they are its decode time
    count, total = hist("inter_token_latency_seconds")
    assert count == sum(r["output_tokens"] - 1 for r in reqs)
    decode = sum(r["tpot"] * (r["output_tokens"] - 1) for r in reqs)
    assert total == pytest.approx(decode, rel=0.01, abs=1e-4)
    assert hist("request_decode_time_seconds")[1] == pytest.approx(decode, rel=0.01, abs=1e-4)
    assert metric(text, "vllm:generation_tokens_total") == stats["output_tokens"]


def test_the_live_fold_forgets_what_it_has_observed() -> None:
    """A server runs for days: the live fold keeps the requests in flight, not the run."""
    from engine.metrics import LiveMetrics

    live = LiveMetrics()
    ttft: list[float] = []
    finished = 0
    for s in range(0, 3000, 3):  # a request every 3 steps: arrives, decodes, finishes
        ref = s // 3
        arrive = Step(s, arrivals=(_arrival(ref, 8),), scheduled=(Scheduled(ref, 8, 0, 0),))
        obs = [live.step(arrive, s + 1.0)]
        obs.append(live.step(Step(s + 1, scheduled=(Scheduled(ref, 1, 2, 8),)), s + 2.0))
        done = Step(s + 2, scheduled=(Scheduled(ref, 1, 2, 9),), finishes=(Finish(ref, 4),))
        obs.append(live.step(done, s + 3.0))
        ttft += [t for o in obs for t in o.ttft]
        finished += sum(len(o.finished) for o in obs)
        assert obs[2].finished[0][1].tpot == pytest.approx(1.0)
    assert finished == 1000 and ttft == [s + 1.0 - float(s // 3) for s in range(0, 3000, 3)]
    assert not live.fold.reqs and len(live.ends) < 70


def test_the_tuis_request_figures_are_the_stats(tmp_path: Path) -> None:
    """The TUI's per-request queued and TTFT (steps) are what `stats --json` says of the
    same trace: the fold's step-unit definitions."""
    from tui.viewmodel import _rows

    trace = tmp_path / "sim.trace"
    _cli("sim", "--trace", str(trace))
    stats = json.loads(_cli("stats", str(trace), "--json"))
    assert stats["unit"] == "steps"
    want = {r["request_id"]: r for r in stats["requests"]}
    ttft: dict[str, int] = {}
    queued: dict[str, int] = {}
    with TraceReader(trace) as reader:
        tl = Timeline(reader)
        for i in range(tl.first_step, tl.last_step + 1):
            for row in _rows(tl.state(i), None, {}):
                if row.ttft is not None:
                    ttft.setdefault(row.request_id, row.ttft)
                if row.queued is not None and not row.still_queued:
                    queued.setdefault(row.request_id, row.queued)
    assert len(ttft) >= len(want) - 2  # one-token requests finish in their first step
    for rid, t in ttft.items():
        assert t == want[rid]["ttft"], rid
    assert queued and all(q == want[rid]["queue"] for rid, q in queued.items())


def test_a_serve_trace_with_an_idle_gap_has_no_step_longer_than_its_work(
    tmp_path: Path,
) -> None:
    """A server waits for its first request and between requests: that wait is idle,
    not the next step's work, and `find 'slow>1000'` does not hit it (issue 24)."""
    import asyncio

    from tests.test_serve_app import served

    trace = tmp_path / "serve.trace"
    gap = 1.1  # the idle to produce, not a wait for anything

    async def go() -> None:
        async with served(trace) as (client, _):
            for _ in range(2):
                await asyncio.sleep(gap)  # the server idles: before step 0, then between
                b = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
                assert (await client.post("/v1/completions", json=b)).status_code == 200

    asyncio.run(go())
    with TraceReader(trace) as reader:
        recs = list(reader.steps())
    prev = 0
    idle = []
    for rec in recs:
        assert 0 < rec.work_ns < 1e9 and rec.duration_ns(prev) == rec.work_ns
        idle.append(rec.idle_ns(prev))
        prev = rec.time_ns
    assert idle[0] > gap * 1e9 and sorted(idle)[-2] > gap * 1e9  # step 0's wait, the gap
    with TraceReader(trace) as reader:
        assert list(find_all(Timeline(reader), [parse("slow>1000")])) == []
    stats = trace_stats(trace)
    assert stats.idle_s > 2 * gap and stats.work_s < stats.duration_s - 2 * gap


def test_client_figures_are_vllm_bench_serves() -> None:
    """The client side's definitions live beside the engine side's (engine.metrics)."""
    from engine.metrics import ClientRequest, client_metrics

    m = client_metrics(
        [
            ClientRequest(0.01, 0.1, [0.02, 0.04], 0.16, 3),  # TPOT (0.16 - 0.1) / 2
            ClientRequest(0.02, 0.3, [], 0.3, 1),  # one token: no TPOT
            ClientRequest(0.03, 0.2, [0.05], None, 2),  # its client left: no e2e, no TPOT
        ]
    )
    assert m.tpot_p50 == pytest.approx(0.03) and m.tpot_p99 == pytest.approx(0.03)
    assert m.ttft_p50 == pytest.approx(0.2) and m.queue_p50 == pytest.approx(0.02)
    assert m.itl_p50 == pytest.approx(0.04) and m.e2e_p50 == pytest.approx(0.23)


def test_the_live_fold_keeps_the_steps_a_request_in_flight_needs() -> None:
    from engine.metrics import LiveMetrics

    live = LiveMetrics()
    long = Step(0, arrivals=(_arrival(0, 8),), scheduled=(Scheduled(0, 8, 0, 0),))
    live.step(long, 1.0)
    for s in range(1, 299):  # it decodes every step while short ones come and go
        entries = [Scheduled(0, 1, 2, 7 + s)]
        arrivals: tuple[Arrival, ...] = ()
        finishes: tuple[Finish, ...] = ()
        if s % 2:
            arrivals = (_arrival(s, 4),)
            entries.append(Scheduled(s, 4, 0, 0))
        else:
            entries.append(Scheduled(s - 1, 1, 2, 4))
            finishes = (Finish(s - 1, 4),)
        live.step(Step(s, arrivals=arrivals, scheduled=tuple(entries), finishes=finishes), s + 1.0)
    end = Step(299, scheduled=(Scheduled(0, 1, 2, 306),), finishes=(Finish(0, 4),))
    obs = live.step(end, 300.0)
    (life, times) = obs.finished[0]
    assert life.ref == 0 and times.tpot == pytest.approx(1.0) and times.e2e == 300.0
    assert times.decode == pytest.approx(299.0) and not live.fold.reqs
    for s in range(300, 400):  # idle steps forget it all
        live.step(Step(s), s + 1.0)
    assert len(live.ends) < 70 and not live.arrivals
