"""The worked numbers of the article the scheduler follows, one test each: arganzheng's
article on vLLM's scheduler, part 4 of 《大模型推理系统揭秘：从 vLLM 看 LLM Serving Infra
核心技术》 (https://arganzheng.life/scheduler-batch-and-fairness.html; docs/contracts.md)."""

from __future__ import annotations

from engine.records import Reason
from tests.helpers import req, run, scheduled, waiting, workload


def test_mixed_batch_leftover_budget_admits_a_chunk() -> None:
    # B and C decode, A has 400 prompt tokens left, D (300) arrives: A 400, B 1, C 1, D 110.
    w = workload(
        [
            req("B", 10, 8),
            req("C", 10, 8),
            req("A", 910, 4, arrival_step=1),
            req("D", 300, 4, arrival_step=2),
        ],
        max_num_batched_tokens=512,
    )
    results, _ = run(w)
    assert scheduled(results[1]) == {"B": 1, "C": 1, "A": 510}
    assert scheduled(results[2]) == {"B": 1, "C": 1, "A": 400, "D": 110}
    assert results[2].report.num_scheduled_tokens == 512


def test_four_1000_token_prompts_with_budget_2048() -> None:
    w = workload(
        [req(f"R{i}", 1000) for i in range(4)], max_num_batched_tokens=2048, max_num_seqs=256
    )
    results, _ = run(w)
    assert scheduled(results[0]) == {"R0": 1000, "R1": 1000, "R2": 48}
    assert waiting(results[0]) == ["R3"]
    assert results[0].report.waiting_stop is not None
    assert results[0].report.waiting_stop.head == Reason.TOKEN_BUDGET


def test_max_num_seqs_keeps_the_257th_waiting_with_budget_left() -> None:
    reqs = [req(f"r{i:03d}", 4, 8) for i in range(256)] + [req("late", 4, 8, arrival_step=1)]
    w = workload(reqs, max_num_batched_tokens=8192, max_num_seqs=256, num_blocks=2000)
    results, _ = run(w)
    step1 = results[1].report
    assert step1.num_scheduled_tokens == 256  # 256 decodes, budget 8192
    assert "late" not in scheduled(results[1])
    assert waiting(results[1]) == ["late"]
    assert step1.waiting_stop is not None and step1.waiting_stop.head == Reason.MAX_NUM_SEQS


def test_long_prefill_threshold_chunks_a_2050_token_prompt() -> None:
    w = workload(
        [req("S", 10, 12), req("L", 2050, 3, arrival_step=1)],
        max_num_batched_tokens=2048,
        long_prefill_token_threshold=512,
    )
    results, _ = run(w)
    chunks = [scheduled(r).get("L") for r in results[1:6]]
    assert chunks == [512, 512, 512, 512, 2]
    capped = [s for s in results[1].report.shortfalls if results[1].names[s.ref] == "L"]
    assert capped and capped[0].reason == Reason.LONG_PREFILL_THRESHOLD


def test_threshold_is_off_for_a_lone_request() -> None:
    w = workload([req("L", 2050, 3)], max_num_batched_tokens=2048, long_prefill_token_threshold=512)
    results, _ = run(w)
    assert [scheduled(r)["L"] for r in results[:2]] == [2048, 2]


def _decodes_plus_arrival(budget: int) -> list[dict[str, int]]:
    reqs = [req(f"d{i:03d}", 4, 20) for i in range(200)]
    reqs.append(req("big", 6000, 2, arrival_step=1))
    w = workload(reqs, max_num_batched_tokens=budget, max_num_seqs=256, num_blocks=3000)
    results, _ = run(w, check=False)
    return [scheduled(r) for r in results[1:3]]


def test_budget_8192_takes_200_decodes_and_a_6000_token_prompt_in_one_step() -> None:
    step1, _ = _decodes_plus_arrival(8192)
    assert sum(step1.values()) == 6200 and step1["big"] == 6000


def test_budget_4200_splits_the_prompt_4000_then_2000() -> None:
    step1, step2 = _decodes_plus_arrival(4200)
    assert step1["big"] == 4000 and sum(step1.values()) == 4200
    assert step2["big"] == 2000 and sum(step2.values()) == 2200
