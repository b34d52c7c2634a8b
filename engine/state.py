"""A full, plain-data picture of the engine at the end of a step: the Snapshot record of
engine.records, which the recorder writes as it is and replays rebuild from a trace alone
(the tests compare the two)."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING

from engine.records import RequestState, Snapshot

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


_ID = attrgetter("block_id")
_REF = attrgetter("ref")


def snapshot(sched: Scheduler) -> Snapshot:
    """The state now: every unfinished request (by ref), the queues and the block map."""
    kv = sched.kv
    tables = kv.req_to_blocks
    requests = tuple(
        RequestState(
            r.ref,
            r.request_id,
            r.status,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_computed_tokens,
            tuple(map(_ID, tables.get(r.request_id, ()))),
            r.num_preemptions,
            r.priority,
            r.arrival_time,
            r.num_cached_tokens,
            r.sampling_params.max_tokens,
            r.arrival_step,
            r.first_scheduled_step,
            r.first_token_step,
        )
        for r in sorted(sched.requests.values(), key=_REF)
    )
    # The pool keeps each cached block's cut hash by block id (None: not cached), so the
    # cached blocks, in id order, are two passes in C over that list: no attribute read
    # off every block, no hash cut here, no new int (the ids are the blocks' own).
    pool = kv.pool
    shorts = pool.short_hashes
    return Snapshot(
        step=sched.step_index - 1,
        next_ref=sched.next_ref,
        requests=requests,
        running=tuple(r.ref for r in sched.running),
        waiting=tuple(r.ref for r in sched.waiting),
        free_queue=tuple(pool.free_queue.ids()),
        cached_block_ids=tuple(compress(pool.block_ids, shorts)),
        cached_hashes=tuple(compress(shorts, shorts)),  # type: ignore[arg-type]
    )
