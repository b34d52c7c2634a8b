"""The what-if step's shortcuts give what the long ways gave: the work read off a
SchedulerOutput, the one-pass trace reading, the vectorised latency metrics, the plain
sampling path of the simulated runner."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from engine.metrics import Lifecycle
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import percentile
from engine.sim.api import demo_workload_path, load, run_sim
from engine.sim.driver import make_engine, run_steps
from engine.sim.runner import SimRunner
from engine.sim.workload import SimWorkload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from replays.costmodel import CostModel, step_work
from replays.scripts import collect_scripts
from replays.timebase import Observer, timed_metrics
from replays.whatif import _read_inputs, scheduled_work, whatif
from tests.helpers import record, req, workload, write_trace

MODEL = CostModel(0.004, {"prefill_tokens": 2e-5, "decode_requests": 1e-4, "context_tokens": 1e-7})


def _mixed(**config: object) -> SimWorkload:
    """Prefill chunks, decodes, shared prefixes and, with a small pool, preemptions."""
    reqs = [req(f"r{i}", 40 + 23 * i, 12 + i, arrival_step=2 * i, base=1000) for i in range(10)]
    return workload(reqs, max_num_batched_tokens=96, max_num_seqs=6, **config)


@pytest.mark.parametrize(
    "config",
    [{}, {"num_blocks": 24}, {"num_speculative_tokens": 3}],
    ids=["plain", "preempting", "spec"],
)
def test_scheduled_work_is_the_step_records_work(config: dict[str, object]) -> None:
    w = _mixed(**config)
    engine = make_engine(w)
    runner = engine.runner
    assert isinstance(runner, SimRunner)
    seen: dict[int, tuple[int, ...]] = {}
    execute = runner.execute

    def spy(out: SchedulerOutput) -> ModelRunnerOutput:
        seen[out.step] = scheduled_work(out)
        return execute(out)

    runner.execute = spy  # type: ignore[method-assign]
    kinds = set()
    for result in run_steps(w, engine):
        rec = result.report
        entries = [(e.num_tokens, e.num_spec_tokens, e.num_computed_before) for e in rec.scheduled]
        kinds |= {e.kind for e in rec.scheduled}
        if entries:
            assert seen[rec.step] == step_work(entries), rec.step
    assert len(seen) > 20 and len(kinds) >= 2


def test_one_pass_reading_gives_the_scripts_of_two(tmp_path: Path) -> None:
    trace = tmp_path / "r.trace"
    run_sim(
        load(demo_workload_path()),
        on_engine=lambda e: open_recording(e, trace, live=False, redact_prompts=True),
    )
    spec = write_trace(tmp_path, record(_mixed(num_speculative_tokens=3)).data, "s.trace")
    for path in (trace, spec):
        st = path.stat()
        inputs = _read_inputs(str(path), st.st_size, st.st_mtime_ns)
        with TraceReader(path) as reader:
            scripts, steps = collect_scripts(reader)
        assert inputs.scripts == scripts and inputs.num_steps == steps > 0
        assert any(s.hashes for s in scripts) or any(s.accepted for s in scripts)


def test_the_recorded_metrics_are_computed_once_and_handed_out_as_copies(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path, record(_mixed()).data)
    a = whatif(trace, {"max_num_batched_tokens": 64}, MODEL, check=False)
    a.recorded.ttft_p50 = -1.0
    b = whatif(trace, {"max_num_seqs": 2}, MODEL, check=False)
    assert b.recorded.ttft_p50 is not None and b.recorded.ttft_p50 > 0
    other = CostModel(0.01)
    c = whatif(trace, None, other, check=False)
    assert c.recorded.duration_s != b.recorded.duration_s  # another model, another clock


def _itl_by_hand(lives: list[Lifecycle], end_ns: list[int]) -> list[float]:
    out = []
    for r in lives:
        steps = r.sample_steps
        out += [(end_ns[b] - end_ns[a]) / 1e9 for a, b in zip(steps, steps[1:])]
    return out


def test_inter_token_latency_between_a_requests_own_steps_only() -> None:
    rng = random.Random(3)
    obs = Observer(100)
    ends = list(np.cumsum([rng.randint(1_000, 9_000_000) for _ in range(400)]).tolist())
    obs.steps = list(range(len(ends)))
    lives = []
    for ref in range(60):
        first = rng.randrange(300)
        steps = sorted(rng.sample(range(first, 400), rng.randint(0, 30)))
        life = Lifecycle(ref, f"r{ref}", first, 0.0, 8, first, len(steps), steps)
        life.finish_step = steps[-1] if steps else -1
        obs.reqs[ref] = life
        lives.append(life)
    m = timed_metrics(obs, ends, [0] * 60, [0, *ends[:-1]])
    itl = _itl_by_hand(lives, ends)
    assert len(itl) > 100
    assert m.itl_p50 == pytest.approx(percentile(itl, 50), rel=1e-12)
    assert m.itl_p99 == pytest.approx(percentile(itl, 99), rel=1e-12)
    assert m.output_tokens == sum(len(r.sample_steps) for r in lives)


def test_plain_sampling_gives_what_the_general_path_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = _mixed(num_blocks=24)

    def tokens() -> list[tuple[int, tuple[int, ...]]]:
        engine = make_engine(w)
        return [(r.report.step, r.report.sampled_tokens or ()) for r in run_steps(w, engine)]

    fast = tokens()
    monkeypatch.setattr(SimRunner, "plain_shortcut", False)
    monkeypatch.setattr(SimRunner, "_sample_plain", None)  # never taken now
    assert tokens() == fast and sum(len(t) for _, t in fast) > 100
