"""Issue 14's property test: random workloads with extreme-but-valid values (priorities
at the ends of int64, token ids up to 2^31-1, caps at their range ends, odd Unicode
ids), priority scheduling and aborts at random steps, recorded into a real trace file.
After every run the trace reads whole, re-simulates to identical decisions, and no KV
block is leaked. (Speculative decoding is added by its own branch.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.limits import INT64_MAX, INT64_MIN, MAX_TOKEN_ID, MAX_TOKENS
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload, parse_workload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from recorder.schema import Step
from replays.resim import resimulate

EXTREME_PRIORITY = st.sampled_from([INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX])
TOKEN = st.one_of(st.integers(0, 30), st.sampled_from([MAX_TOKEN_ID, MAX_TOKEN_ID - 1]))
IDS = st.text(st.characters(blacklist_categories=("Cs",), min_codepoint=1), min_size=1, max_size=12)


@st.composite
def extreme_workloads(draw: st.DrawFn) -> tuple[SimWorkload, dict[int, list[str]]]:
    bs = draw(st.sampled_from([1, 4, 16, 4096]))
    max_num_seqs = draw(st.sampled_from([1, 3, 1 << 16]))
    max_model_len = draw(st.sampled_from([2, 64, MAX_TOKENS]))
    config: dict[str, Any] = dict(
        block_size=bs,
        num_blocks=draw(st.sampled_from([2, 3, 16, 64, 5000])),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_seqs, draw(st.sampled_from([1, 64, MAX_TOKENS]))),
        long_prefill_token_threshold=draw(st.sampled_from([0, 1, max_model_len])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.5, 0.99])),
        scheduler_reserve_full_isl=draw(st.booleans()),
    )
    ids = draw(st.lists(IDS, min_size=1, max_size=8, unique=True))
    prefix = draw(st.lists(TOKEN, max_size=20))
    requests = []
    for rid in ids:
        own = draw(st.lists(TOKEN, min_size=1, max_size=40))
        max_tokens = draw(st.integers(1, 12))
        requests.append(
            dict(
                id=rid,
                arrival_step=draw(st.integers(0, 6)),
                prompt_token_ids=(prefix if draw(st.booleans()) else []) + own,
                output_token_ids=draw(st.lists(TOKEN, max_size=max_tokens)),
                max_tokens=max_tokens,
                priority=draw(EXTREME_PRIORITY),
            )
        )
    aborts: dict[int, list[str]] = {}
    for rid in draw(st.lists(st.sampled_from(ids), max_size=3, unique=True)):
        aborts.setdefault(draw(st.integers(0, 20)), []).append(rid)
    w = parse_workload({"config": config, "requests": requests}, source="hypothesis")
    return w, aborts


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(extreme_workloads())
def test_extreme_workloads_with_aborts_record_read_and_resimulate(
    tmp_path: Path, case: tuple[SimWorkload, dict[int, list[str]]]
) -> None:
    w, aborts = case
    path = tmp_path / "p.trace"
    if path.exists():
        path.unlink()
    engine = make_engine(w)
    recorder = open_recording(engine, path, kind="sim")
    steps = 0
    for result in run_steps(w, engine):
        engine.scheduler.kv.check_invariants()
        for rid in aborts.get(result.report.step, ()):
            engine.abort(rid)
        steps += 1
    engine.close()
    assert recorder.error is None
    kv = engine.scheduler.kv
    assert not kv.req_to_blocks and kv.num_free_blocks == w.config.usable_blocks, "leak"

    with TraceReader(path) as reader:
        recorded = [e.record for e in reader.entries() if isinstance(e.record, Step)]
        assert reader.footer is not None and reader.cut is None
    assert len(recorded) == steps
    result = resimulate(path)
    assert result.divergence is None, result.divergence
