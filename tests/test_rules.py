"""The shared scheduling rules (engine/rules.py), which the scheduler and the vLLM
recorder both call: their edge cases, checked once here."""

from __future__ import annotations

from engine.records import Kind, QueueStop, Reason, Sample
from engine.rules import (
    admission_failure,
    cut_short,
    entry_kind,
    layout_samples,
    long_prefill_cap,
    queue_stop,
    waiting_limit,
)


def test_long_prefill_cap_is_off_for_a_lone_request_and_adapts_to_the_share() -> None:
    assert long_prefill_cap(64, False, 2048, 1) == 0
    assert long_prefill_cap(64, False, 2048, 2) == 64
    assert long_prefill_cap(64, True, 2048, 4) == 512
    assert long_prefill_cap(0, True, 2048, 4) == 0


def test_cut_short_names_the_last_cap_that_bit() -> None:
    assert cut_short(10, 0, 100, 100) == (10, None)
    assert cut_short(100, 64, 100, 1000) == (64, Reason.LONG_PREFILL_THRESHOLD)
    assert cut_short(100, 64, 32, 1000) == (32, Reason.TOKEN_BUDGET)
    assert cut_short(100, 64, 32, 5) == (5, Reason.MAX_MODEL_LEN)


def test_entry_kind_in_order_of_precedence() -> None:
    assert entry_kind(1, True, [7], 2) is Kind.SPEC
    assert entry_kind(1, True, [7]) is Kind.CHUNK
    assert entry_kind(1, False, [7]) is Kind.DECODE
    assert entry_kind(1, False, []) is Kind.PREFILL  # async: first sample in flight
    assert entry_kind(5, False, [7]) is Kind.PREFILL


def test_queue_stops_pair_a_head_failure_with_head_of_line() -> None:
    assert queue_stop(Reason.WATERMARK) == QueueStop(Reason.WATERMARK, Reason.HEAD_OF_LINE)
    assert queue_stop(Reason.NO_CHUNKING) == QueueStop(Reason.NO_CHUNKING, Reason.HEAD_OF_LINE)
    assert queue_stop(Reason.TOKEN_BUDGET) == QueueStop(Reason.TOKEN_BUDGET, Reason.TOKEN_BUDGET)
    assert waiting_limit(0, 0, 4) == Reason.TOKEN_BUDGET
    assert waiting_limit(8, 4, 4) == Reason.MAX_NUM_SEQS
    assert waiting_limit(8, 3, 4) is None


def test_admission_failure_checks_the_chunk_then_the_prompt() -> None:
    def needed(slots: int) -> int:
        return slots // 16

    assert admission_failure(needed, 1, 32, None) == Reason.KV_BLOCKS
    assert admission_failure(needed, 2, 32, 64) == Reason.FULL_PROMPT
    assert admission_failure(needed, 4, 32, 64) == Reason.WATERMARK


def test_layout_samples() -> None:
    assert layout_samples([], {}) == (None, (), ())
    assert layout_samples([1, 2], {}) == ((0, 0), (), ())
    assert layout_samples([1, 2], {1: (5,), 2: (6,)}) == (None, (5, 6), ())
    assert layout_samples([1, 2], {1: (5, 7), 3: (8,)}) == ((2, 0), (5, 7), (Sample(3, 1, (8,)),))
