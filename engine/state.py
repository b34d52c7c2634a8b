"""A full, plain-data picture of the engine at the end of a step: the Snapshot record of
engine.records, which the recorder writes as it is and replays rebuild from a trace alone
(the tests compare the two)."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter
from typing import TYPE_CHECKING

from engine.records import RequestState, Snapshot, trace_hashes

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


_HASH = attrgetter("block_hash")
_ID = attrgetter("block_id")


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
    # A block carries its hash exactly while the hash map holds it (set when it is cached,
    # cleared when it is evicted: engine.kv.block_pool), and block i is blocks[i]: so a
    # pass in C over the pool lists the cached blocks in id order. Sorting (id, hash)
    # pairs from the map cost most of a snapshot (8 ms of 10 at 12,000 cached blocks),
    # and its 12,000 tuples set off young collections on the engine's thread. A hash is
    # a digest, never empty, so its truth says whether the block is cached; the ids are
    # the blocks' own ints (a range's would be made anew, one object each above 256).
    blocks = kv.pool.blocks
    hashes = list(map(_HASH, blocks))
    return Snapshot(
        step=sched.step_index - 1,
        next_ref=sched.next_ref,
        requests=requests,
        running=tuple(r.ref for r in sched.running),
        waiting=tuple(r.ref for r in sched.waiting),
        free_queue=tuple(kv.pool.free_queue.ids()),
        cached_block_ids=tuple(map(_ID, compress(blocks, hashes))),
        cached_hashes=trace_hashes(list(compress(hashes, hashes))),
    )
