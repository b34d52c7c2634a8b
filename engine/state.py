"""A full, plain-data picture of the engine at the end of a step.

The recorder writes it as a snapshot record; replays rebuild the same picture from a
trace alone, and the tests compare the two."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from engine.request import RequestStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class RequestState:
    """One unfinished request."""

    request_id: str  # request id
    status: RequestStatus  # WAITING, RUNNING or PREEMPTED
    num_prompt_tokens: int  # prompt length
    num_output_tokens: int  # tokens sampled so far
    num_computed_tokens: int  # tokens in the KV cache
    block_ids: tuple[int, ...]  # its block table
    num_preemptions: int  # times preempted
    priority: int  # lower runs first under the priority policy
    num_cached_tokens: int  # prefix-hit tokens at first admission (-1: not yet admitted)


@dataclass(frozen=True, slots=True)
class EngineState:
    """Requests, queues and the block map after step `step`."""

    step: int  # the last step applied (-1: before the first)
    requests: tuple[RequestState, ...]  # unfinished requests, sorted by id
    running: tuple[str, ...]  # running queue, in order
    waiting: tuple[str, ...]  # waiting queue, in admission order
    free_queue: tuple[int, ...]  # free block ids, head (reused first) to tail
    ref_cnts: tuple[int, ...]  # per block id (empty when the snapshot left them out)
    block_hashes: tuple[tuple[int, bytes], ...]  # (block id, hash) of cached blocks, by id


def snapshot(sched: Scheduler, ref_cnts: bool = True) -> EngineState:
    """The state now. `ref_cnts=False` leaves them out (empty): they follow from the block
    tables, and counting every block is a good part of a snapshot's cost."""
    kv = sched.kv
    requests = tuple(
        RequestState(
            r.request_id,
            r.status,
            r.num_prompt_tokens,
            r.num_output_tokens,
            r.num_computed_tokens,
            tuple(kv.get_block_ids(r.request_id)),
            r.num_preemptions,
            r.priority,
            r.num_cached_tokens,
        )
        for r in sorted(sched.requests.values(), key=lambda r: r.request_id)
    )
    pool = kv.pool
    return EngineState(
        step=sched.step_index - 1,
        requests=requests,
        running=tuple(r.request_id for r in sched.running),
        waiting=tuple(r.request_id for r in sched.waiting),
        free_queue=tuple(pool.free_queue.ids()),
        ref_cnts=tuple(map(attrgetter("ref_cnt"), pool.blocks)) if ref_cnts else (),
        block_hashes=tuple(
            sorted((block_id, h) for h, entry in pool.cached.items() for block_id in entry)
        ),
    )
