"""The scheduling rules that decide what a step record says, each defined once.

The scheduler calls them on its own state; the vLLM recorder (`recorder/vllm/tap.py`)
maps vLLM's scheduler state into the same arguments, so that a trace recorded inside
vLLM says what schedtop's scheduler would have said of the same decision. Pure functions
of plain values: no engine state, no torch (the scheduling path stays pure Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import chain

from engine.records import Kind, QueueStop, Reason, Sample

# A request-level failure at the head of waiting blocks everyone behind it (S7).
_HEAD_FAILURES = frozenset(
    (Reason.KV_BLOCKS, Reason.FULL_PROMPT, Reason.WATERMARK, Reason.NO_CHUNKING)
)


def long_prefill_cap(
    threshold: int, adaptive: bool, max_num_batched_tokens: int, num_eligible: int
) -> int:
    """The long-prefill cap in force for a step (S3): off (0) when at most one request
    runs or waits; adaptive, at least an equal share of the budget."""
    if num_eligible <= 1 or not threshold:
        return 0
    if adaptive:
        return max(threshold, max_num_batched_tokens // num_eligible)
    return threshold


# Reasons bound once: a member read through its enum class costs about 0.1 µs on Python
# 3.11 (EnumType.__getattr__'s hook), and these run a few times every step.
_THRESHOLD, _BUDGET, _MAX_LEN = (
    Reason.LONG_PREFILL_THRESHOLD,
    Reason.TOKEN_BUDGET,
    Reason.MAX_MODEL_LEN,
)
_MAX_SEQS, _HEAD_OF_LINE = Reason.MAX_NUM_SEQS, Reason.HEAD_OF_LINE


def cut_short(wanted: int, threshold: int, budget: int, room: int) -> tuple[int, Reason | None]:
    """The tokens a request gets of the `wanted`, and the last cap that cut it (S4, S7):
    the long-prefill cap, then the budget left, then `room` before max_model_len."""
    n, reason = wanted, None
    if 0 < threshold < n:
        n, reason = threshold, _THRESHOLD
    if n > budget:
        n, reason = budget, _BUDGET
    if n > room:
        n, reason = room, _MAX_LEN
    return n, reason


# Module constants: entry_kind runs for every entry of every step.
_SPEC, _CHUNK, _DECODE, _PREFILL = Kind.SPEC, Kind.CHUNK, Kind.DECODE, Kind.PREFILL


def entry_kind(n: int, chunk: bool, output: object, num_spec: int = 0) -> Kind:
    """The kind of a scheduled entry of `n` tokens. `chunk`: the request's prefill goes
    on after this step; `output`: its sampled tokens, truthy once it has one (async: a
    first decode whose sample is still in flight is a PREFILL); `num_spec`: its drafts."""
    if num_spec:
        return _SPEC
    if chunk:
        return _CHUNK
    if n == 1 and output:
        return _DECODE
    return _PREFILL


def admission_failure(
    needed: Callable[[int], int], free: int, slots: int, full_slots: int | None
) -> Reason:
    """Which admission test failed (K3, K6, S8), given the blocks `needed` for a number of
    token slots: those of the tokens to compute (`slots`), then those of the whole prompt
    (`full_slots`; None when scheduler_reserve_full_isl is off); else the watermark."""
    if needed(slots) > free:
        return Reason.KV_BLOCKS
    if full_slots is not None and needed(full_slots) > free:
        return Reason.FULL_PROMPT
    return Reason.WATERMARK


def waiting_limit(budget: int, num_running: int, max_running: int) -> Reason | None:
    """The step limit that ends the waiting pass before the next admission, if any (S7)."""
    if budget <= 0:
        return _BUDGET
    if num_running >= max_running:
        return _MAX_SEQS
    return None


def queue_stop(reason: int) -> QueueStop:
    """A pass's stop for `reason`: a failure of the head of waiting leaves the rest
    behind it head-of-line; a step limit (budget, max_num_seqs, preemption, KV in the
    running pass) stops everyone for the same reason."""
    return QueueStop(reason, _HEAD_OF_LINE if reason in _HEAD_FAILURES else reason)


def running_kv_stop() -> QueueStop:
    """The running pass's stop when a request preempted itself under FCFS (S5)."""
    return QueueStop(Reason.KV_BLOCKS, Reason.KV_BLOCKS)


def one_each(counts: Iterable[int], num_tokens: int, num_entries: int) -> bool:
    """Whether every entry sampled exactly one token: a record then keeps no counts."""
    return num_tokens == num_entries and 0 not in counts


def layout_samples(
    refs: Iterable[int], by_ref: dict[int, tuple[int, ...]]
) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[Sample, ...]]:
    """Samples (ref -> tokens) laid out against a step's entries (their refs, in order):
    per-entry counts (None: one each), the tokens in entry order, and the samples of
    requests without an entry (async: an earlier batch's, of a request not scheduled
    again). Consumes `by_ref`."""
    if not by_ref:
        counts = tuple(0 for _ in refs)
        return (counts or None), (), ()
    pop = by_ref.pop
    per_entry = [pop(ref, ()) for ref in refs]
    flat = tuple(chain.from_iterable(per_entry))
    others = tuple(Sample(ref, len(toks), toks) for ref, toks in by_ref.items())
    counts = tuple(map(len, per_entry))
    if not others and one_each(counts, len(flat), len(counts)):
        return None, flat, ()
    return counts, flat, others
