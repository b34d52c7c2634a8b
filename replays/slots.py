"""A token pool slot by slot (format 1.9, Header.slot_map): SGLang's KV pool as its trace
rebuilds it. Each running request's row (the slots of its tokens, in token order, as
SGLang's req_to_token holds them), the free slots, and how many slots the radix cache holds
that nobody uses (evictable). A slot that is neither free nor in a row is the radix cache's
(evictable, or held for a request that is not running)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from recorder.errors import TraceError
from recorder.schema import SlotWrite


class SlotsInconsistent(TraceError):
    """Slot records that do not fit the pool they are applied to."""


def expand(runs: Sequence[int], size: int) -> list[int]:
    """The slots of runs (start, length, start, length, ...) in a pool of `size` slots
    (each run checked inside it before it is expanded: a trace may be hostile)."""
    if len(runs) % 2:
        raise SlotsInconsistent(f"slot runs of odd length {len(runs)}")
    out: list[int] = []
    for i in range(0, len(runs), 2):
        start, n = runs[i], runs[i + 1]
        if not (start > 0 and start + n <= size):
            raise SlotsInconsistent(f"slots {start}..{start + n - 1} outside the pool")
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

    def _run(self, runs: Sequence[int], i: int) -> tuple[int, int]:
        start, n = runs[i], runs[i + 1]
        if not (start > 0 and start + n <= self.size):
            raise SlotsInconsistent(f"slots {start}..{start + n - 1} outside the pool")
        return start, n

    def release(self, runs: Sequence[int]) -> None:
        """Slots back to the free list (a run at a time: a finished request's hundreds
        of slots are a few runs once sorted)."""
        if len(runs) % 2:
            raise SlotsInconsistent(f"slot runs of odd length {len(runs)}")
        free = self.free
        for i in range(0, len(runs), 2):
            start, n = self._run(runs, i)
            if free.count(1, start, start + n):
                raise SlotsInconsistent(f"slots {start}..{start + n - 1} freed, but one is free")
            free[start : start + n] = b"\x01" * n
            self.num_free += n

    def take(self, runs: Sequence[int]) -> list[int]:
        """Free slots handed out: the slots, in order."""
        slots = expand(runs, self.size)
        free = self.free
        for i in range(0, len(runs), 2):
            start, n = runs[i], runs[i + 1]
            if free.count(0, start, start + n):
                raise SlotsInconsistent(
                    f"slots {start}..{start + n - 1} handed out, but one is not free"
                )
            free[start : start + n] = bytes(n)
            self.num_free -= n
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
