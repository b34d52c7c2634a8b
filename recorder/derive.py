"""The queue orders a step record may leave out, derived from the previous step's queues
and the step's changes (docs/contracts.md S4-S7, S10).

The recorder writes a queue only when this derivation disagrees with the engine, and the
reducer applies the same functions, so the two cannot drift apart. Elements are whatever
names requests (ids in the recorder, refs in the reducer), unique among live requests.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import suppress
from itertools import chain
from typing import Any, TypeVar

T = TypeVar("T")


def running_after(prev: Sequence[T], gone: Collection[T], admitted: Sequence[T]) -> list[T]:
    """Running keeps admission order: what stays, then the newly admitted.

    `gone` holds the step's preempted and finished requests."""
    if not gone:
        return [*prev, *admitted]
    if len(gone) <= 4:
        # A step's usual few: C-level removals (names are unique among live requests)
        # rather than a membership test per running request.
        out = [*prev, *admitted]
        for r in gone:
            with suppress(ValueError):  # not running (a waiting request finished)
                out.remove(r)
        return out
    return [r for r in chain(prev, admitted) if r not in gone]


def waiting_after_fcfs(
    prev: Sequence[T], arrived: Sequence[T], preempted: Sequence[T], gone: Collection[T]
) -> list[T]:
    """FCFS: arrivals join the back; each preempted request is put at the front, so the last
    preempted is first. `gone` holds the admitted and finished requests."""
    rest = chain(prev, arrived)
    kept = list(rest) if not gone else [r for r in rest if r not in gone]
    return [*reversed(preempted), *kept]


def waiting_after_priority(
    prev: Iterable[T],
    arrived: Iterable[T],
    preempted: Iterable[T],
    gone: Collection[T],
    key: Callable[[T], Any],
) -> list[T]:
    """PRIORITY: the waiting set in (priority, arrival_time, request_id) order."""
    return sorted((r for r in chain(prev, arrived, preempted) if r not in gone), key=key)


def leading_decodes(running: list[int], num_decodes: int, skips: Collection[int]) -> list[int]:
    """A step's implicit decode entries: the first `num_decodes` requests of `running` (the
    running queue as schedule() found it) once the step's `decode_skips` are taken out.
    Raises ValueError when the record cannot fit that queue."""
    if skips:
        missing = set(skips).difference(running)
        if missing or len(set(skips)) != len(skips):
            raise ValueError(
                f"decode_skips {sorted(skips)} are not distinct running requests "
                f"(not running: {sorted(missing)})"
            )
        gone = set(skips)
        running = [r for r in running if r not in gone]
    if num_decodes > len(running):
        raise ValueError(f"{num_decodes} leading decodes but {len(running)} running requests")
    return running[:num_decodes]
