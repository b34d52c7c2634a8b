"""A token pool slot by slot (format 1.9, Header.slot_map): SGLang's KV pool as its trace
rebuilds it. Each running request's row (the slots of its tokens, in token order, as
SGLang's req_to_token holds them), the free slots, and how many slots the radix cache holds
that nobody uses (evictable). A slot that is neither free nor in a row is the radix cache's
(evictable, or held for a request that is not running)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import add, itemgetter

from recorder.errors import TraceError
from recorder.schema import SlotWrite


class SlotsInconsistent(TraceError):
    """Slot records that do not fit the pool they are applied to."""


def expand(runs: Sequence[int], size: int) -> list[int]:
    """The slots of runs (start, length, start, length, ...) in a pool of `size` slots
    (each run checked inside it before it is expanded: a trace may be hostile)."""
    if len(runs) % 2:
        raise SlotsInconsistent(f"slot runs of odd length {len(runs)}")
    if not runs:
        return []
    starts, lens = runs[0::2], runs[1::2]
    # C-level checks: decode slots interleave across requests, so most runs are one slot
    if min(starts) < 1 or max(map(add, starts, lens)) > size:
        bad = next(i for i in range(len(starts)) if not 0 < starts[i] <= size - lens[i])
        raise SlotsInconsistent(
            f"slots {starts[bad]}..{starts[bad] + lens[bad] - 1} outside the pool"
        )
    if lens.count(1) == len(lens):
        return list(starts)
    out: list[int] = []
    for start, n in zip(starts, lens):
        out.extend(range(start, start + n))
    return out


def to_runs(slots: Iterable[int]) -> tuple[int, ...]:
    """Slots as runs of consecutive ids (SGLang hands out mostly contiguous runs, so a
    2,000-token prompt is usually one run: two integers)."""
    out: list[int] = []
    start = prev = -2
    for s in slots:
        if s != prev + 1:
            if start >= 0:
                out += (start, prev - start + 1)
            start = s
        prev = s
    if start >= 0:
        out += (start, prev - start + 1)
    return tuple(out)


def _values(free: bytearray, slots: list[int]) -> tuple[int, ...]:
    """free[s] for each slot, in one C-level call."""
    if len(slots) < 2:
        return (free[slots[0]],) if slots else ()
    return itemgetter(*slots)(free)  # type: ignore[no-any-return]


@dataclass(slots=True)
class SlotPool:
    """The pool's slots 1..size-1 (slot 0 is SGLang's padding slot, never handed out)."""

    size: int  # slots, the padding slot 0 included (the header's num_blocks)
    free: bytearray  # per slot: 1 when free
    num_free: int
    rows: dict[int, list[int]]  # running request -> its slots by token position
    evictable: int = 0  # slots the radix cache holds that no request uses

    @classmethod
    def initial(cls, size: int) -> SlotPool:
        free = bytearray([1]) * size
        free[0] = 0
        return cls(size, free, size - 1, {})

    @classmethod
    def from_snapshot(
        cls, size: int, rows: Sequence[SlotWrite], free_runs: Sequence[int], evictable: int
    ) -> SlotPool:
        pool = cls(size, bytearray(size), 0, {}, evictable)
        pool.release(free_runs)
        for w in rows:
            if w.ref in pool.rows or w.position:
                raise SlotsInconsistent(f"snapshot: bad slot row for request {w.ref}")
            pool.rows[w.ref] = []
            pool.write(w.ref, 0, w.runs)
        return pool

    def copy(self) -> SlotPool:
        return SlotPool(
            self.size,
            bytearray(self.free),
            self.num_free,
            {ref: list(row) for ref, row in self.rows.items()},
            self.evictable,
        )

    def snapshot_rows(self) -> tuple[SlotWrite, ...]:
        return tuple(SlotWrite(ref, 0, to_runs(self.rows[ref])) for ref in sorted(self.rows))

    def free_runs(self) -> tuple[int, ...]:
        free = self.free
        return to_runs(i for i in range(self.size) if free[i])

    def _check(self, slot: int) -> None:
        if not 0 < slot < self.size:
            raise SlotsInconsistent(f"slot {slot} outside the pool (1..{self.size - 1})")

    def release(self, runs: Sequence[int]) -> None:
        """Slots back to the free list."""
        slots = expand(runs, self.size)
        free = self.free
        if 1 in _values(free, slots):
            bad = next(s for s in slots if free[s])
            raise SlotsInconsistent(f"slot {bad} freed, but it is free")
        for s in slots:
            free[s] = 1
        self.num_free += len(slots)
        if len(set(slots)) != len(slots):
            raise SlotsInconsistent("a slot freed twice in one step")

    def take(self, runs: Sequence[int]) -> list[int]:
        """Free slots handed out: the slots, in order."""
        slots = expand(runs, self.size)
        free = self.free
        if 0 in _values(free, slots):
            bad = next(s for s in slots if not free[s])
            raise SlotsInconsistent(f"slot {bad} handed out, but it is not free")
        for s in slots:
            free[s] = 0
        self.num_free -= len(slots)
        if len(set(slots)) != len(slots):
            raise SlotsInconsistent("a slot handed out twice in one step")
        return slots

    def place(self, ref: int, position: int, slots: Sequence[int]) -> None:
        """`slots` become the row's from `position` on (a gap before it, which a write
        of the same step fills, holds the padding slot 0)."""
        row = self.rows.get(ref)
        if row is None:
            raise SlotsInconsistent(f"slots for request {ref}, which is not running")
        if len(row) < position:
            row.extend([0] * (position - len(row)))
        row[position : position + len(slots)] = slots

    def write(self, ref: int, position: int, runs: Sequence[int]) -> None:
        """Slots the cache holds (not free) written into a row."""
        slots = expand(runs, self.size)
        free = self.free
        for s in slots:
            self._check(s)
            if free[s]:
                raise SlotsInconsistent(f"free slot {s} written into request {ref}'s row")
        self.place(ref, position, slots)

    def owners(self) -> tuple[bytearray, dict[int, list[int]]]:
        """Per slot how many rows hold it (capped at 255), and the rows."""
        held = bytearray(self.size)
        for row in self.rows.values():
            for s in row:
                if held[s] < 255:
                    held[s] += 1
        held[0] = 0
        return held, self.rows
