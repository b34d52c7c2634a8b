"""Scheduler behaviour beyond the fidelity cases: reasons, aborts, errors, spec decode."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.records import Kind, Reason
from engine.request import Request, SamplingParams, Status
from engine.sim.driver import make_engine, run_steps
from engine.sim.runner import SimRunner
from tests.helpers import req, run, scheduled, waiting, workload


def engine(**cfg: object) -> EngineCore:
    config = EngineConfig().replace(**cfg)
    return EngineCore(config, SimRunner({}))


def request(rid: str, n: int, max_tokens: int = 4, bs: int = 16, **kw: object) -> Request:
    return Request(
        rid,
        list(range(1000, 1000 + n)),
        SamplingParams(max_tokens=max_tokens),
        block_hasher=BlockHasher(bs),
        **kw,
    )  # type: ignore[arg-type]


def test_prompt_too_long_for_the_pool_finishes_with_error_and_others_go_on() -> None:
    e = engine(num_blocks=5, block_size=16)
    e.add_request(request("huge", 100))
    e.add_request(request("ok", 10))
    assert e.scheduler.requests.keys() == {"ok"}
    result = e.step()
    assert [result.names[f.ref] for f in result.report.finishes] == ["huge"]
    assert result.report.finishes[0].status == Status.FINISHED_ERROR
    assert "KV blocks" in result.report.finishes[0].message
    while e.has_unfinished():
        e.step()


def test_prompt_of_max_model_len_is_an_error() -> None:
    e = engine(max_model_len=64)
    e.add_request(request("long", 64))
    finished = e.take_finished()
    assert finished[0].status == Status.FINISHED_ERROR
    assert "max_model_len" in finished[0].finish_message


def test_duplicate_request_id_is_refused() -> None:
    e = engine()
    e.add_request(request("a", 4))
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        e.add_request(request("a", 4))


def test_abort_from_waiting_and_from_running_frees_blocks() -> None:
    e = engine(num_blocks=20, max_num_seqs=1, max_num_batched_tokens=64)
    e.add_request(request("run", 40, 100))
    e.add_request(request("wait", 40, 100))
    e.step()
    assert [r.request_id for r in e.scheduler.running] == ["run"]
    free_before = e.scheduler.kv.num_free_blocks
    assert e.abort("wait") and e.abort("run")
    assert not e.abort("nobody")
    assert e.scheduler.kv.num_free_blocks == free_before + 3
    result = e.step()
    assert {result.names[f.ref]: f.status for f in result.report.finishes} == {
        "wait": Status.FINISHED_ABORTED,
        "run": Status.FINISHED_ABORTED,
    }
    assert not e.has_unfinished()
    e.scheduler.kv.check_invariants()


def test_running_request_that_outgrows_the_pool_ends_with_error() -> None:
    # 4 usable blocks of 16 = 64 tokens; the request wants 40 + 100 tokens.
    w = workload([req("grow", 40, 100)], num_blocks=5, max_model_len=1000)
    results, _ = run(w)
    finishes = [(r.names[f.ref], f.status) for r in results for f in r.report.finishes]
    assert finishes == [("grow", Status.FINISHED_ERROR)]
    assert any(r.names[p.victim] == "grow" for r in results for p in r.report.preemptions)


def test_kinds_prefill_chunk_decode() -> None:
    w = workload([req("a", 40, 3)], max_num_batched_tokens=16, max_num_seqs=4)
    results, _ = run(w)
    kinds = [r.report.scheduled[0].kind for r in results]
    assert kinds == [Kind.CHUNK, Kind.CHUNK, Kind.PREFILL, Kind.DECODE, Kind.DECODE]


def test_waiting_head_fails_the_full_prompt_check_and_the_rest_wait_behind_it() -> None:
    w = workload(
        [req("a", 100, 30), req("b", 100, 2, arrival_step=1), req("c", 10, 2, arrival_step=1)],
        num_blocks=12,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=32,
    )
    results, _ = run(w)
    stop = results[1].report.waiting_stop
    assert stop is not None
    assert (stop.head, stop.rest) == (Reason.FULL_PROMPT, Reason.HEAD_OF_LINE)
    assert waiting(results[1]) == ["b", "c"]


def test_watermark_reason() -> None:
    w = workload(
        [req("a", 48, 20), req("b", 80, 4, arrival_step=1)],
        num_blocks=10,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        watermark=0.1,
    )
    results, _ = run(w)
    reasons = [r.report.waiting_stop.head for r in results if r.report.waiting_stop]
    assert Reason.WATERMARK in reasons


def test_preemption_skips_the_waiting_pass_with_a_reason() -> None:
    w = workload(
        [
            req("a", 40, 40, base=90000),
            req("b", 40, 40, base=90000),
            req("c", 40, 40, arrival_step=1, base=90000),
            req("late", 4, 2, arrival_step=25),
        ],
        num_blocks=10,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    results, _ = run(w)
    step = next(r for r in results if r.report.preemptions)
    assert step.names[step.report.preemptions[0].victim] == "c"
    assert step.names[step.report.preemptions[0].for_request] == "b"
    assert step.report.preemptions[0].tokens_lost > 0
    assert not step.report.admissions
    assert step.report.waiting_stop is not None
    assert step.report.waiting_stop.head == Reason.PREEMPTION


def test_priority_unschedules_a_victim_already_scheduled_this_step() -> None:
    w = workload(
        [req("B", 40, 40, priority=5), req("A", 48, 40, arrival_step=1, priority=1)],
        num_blocks=7,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        policy="priority",
    )
    results, _ = run(w)
    step = next(r for r in results if r.report.preemptions)
    p = step.report.preemptions[0]
    names = step.names
    assert (names[p.victim], names[p.for_request], p.unscheduled_tokens) == ("B", "A", 1)
    assert "B" not in scheduled(step)


def test_spec_decode_outputs_match_the_script_and_drafts_are_verified() -> None:
    w = workload(
        [req("a", 20, 30), req("b", 33, 25, arrival_step=2)],
        num_speculative_tokens=3,
        num_blocks=40,
    )
    results, engine_ = run(w)
    kinds = {s.kind for r in results for s in r.report.scheduled}
    assert Kind.SPEC in kinds
    accepted = sum(a.accepted for r in results for a in r.report.spec_accepted)
    assert accepted > 0
    outputs: dict[str, list[int]] = {}
    for r in results:
        for rid, toks in r.sampled().items():
            outputs.setdefault(rid, []).extend(toks)
    assert outputs["a"] == list(range(7, 37)) and outputs["b"] == list(range(7, 32))
    # Fewer steps than one token per step: drafts were accepted.
    assert len(results) < 2 + 30


def test_stop_token_and_eos_end_a_request() -> None:
    e = engine()
    r1 = request("stop", 4, 50)
    r1.sampling_params = SamplingParams(max_tokens=50, stop_token_ids=(9,))
    r2 = Request("eos", [1, 2, 3], SamplingParams(max_tokens=50), eos_token_id=8)
    e.runner = SimRunner({"stop": [5, 9, 1], "eos": [7, 8, 1]})
    e.add_request(r1)
    e.add_request(r2)
    while e.has_unfinished():
        e.step()
    assert r1.output_token_ids == [5, 9] and r1.status == Status.FINISHED_STOPPED
    assert r1.stop_reason == 9
    assert r2.output_token_ids == [7, 8] and r2.status == Status.FINISHED_STOPPED


def test_scheduler_and_step_driver_import_neither_torch_nor_numpy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, engine.scheduler, engine.driver, engine.sim.driver; "
        "print('torch' in sys.modules or 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_take_finished_returns_what_schedule_itself_ends() -> None:
    # The request outgrows the 4-block pool, is preempted, and schedule() ends it with an
    # error when it would come back: take_finished() must return it like any other finish.
    w = workload([req("grow", 40, 100)], num_blocks=5, max_model_len=1000)
    engine = make_engine(w)
    taken = []
    for _ in run_steps(w, engine):
        taken += engine.take_finished()
    assert [(r.request_id, r.status) for r in taken] == [("grow", Status.FINISHED_ERROR)]
