"""A full, plain-data picture of the engine at the end of a step: the Snapshot record of
engine.records, which the recorder writes as it is and replays rebuild from a trace alone
(the tests compare the two)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.records import RequestState, Snapshot, trace_hashes

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


def snapshot(sched: Scheduler) -> Snapshot:
    """The state now: every unfinished request (by ref), the queues and the block map."""
    kv = sched.kv
    requests = tuple(
        RequestState(
            r.ref,
            r.request_id,
            r.status,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_computed_tokens,
            tuple(kv.get_block_ids(r.request_id)),
            r.num_preemptions,
            r.priority,
            r.arrival_time,
            r.num_cached_tokens,
            r.sampling_params.max_tokens,
            r.arrival_step,
            r.first_scheduled_step,
            r.first_token_step,
        )
        for r in sorted(sched.requests.values(), key=lambda r: r.ref)
    )
    cached = sorted((block.block_id, h) for h, block in kv.pool.cached_blocks())
    return Snapshot(
        step=sched.step_index - 1,
        next_ref=sched.next_ref,
        requests=requests,
        running=tuple(r.ref for r in sched.running),
        waiting=tuple(r.ref for r in sched.waiting),
        free_queue=tuple(kv.pool.free_queue.ids()),
        cached_block_ids=tuple(b for b, _ in cached),
        cached_hashes=trace_hashes([h for _, h in cached]),
    )
