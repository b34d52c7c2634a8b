"""Wait accounting: how long each request has gone without being scheduled, across
preemptions (a preempted request's wait goes on; it does not start again), and why.

Each step's digest (tui.history) lists the unfinished requests the step did not schedule,
each with the reason the step record gives (its shortfall, its preemption, or why its
queue's pass stopped). A `WaitBook` runs over consecutive digests: a request's wait is
the run of steps since the last one that scheduled it, and its breakdown counts that
run's reasons. Only digested steps are seen: a request already waiting at the first of
them has a wait of at least that long (shown as `N+`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from recorder.schema import WAIT_LABELS
from replays.queueing import decoders, unscheduled

__all__ = ["Wait", "WaitBook", "breakdown", "decoders", "unscheduled"]

if TYPE_CHECKING:
    from tui.history import Digest

MAX_WALK = 4096  # digests a rebuilt book goes back over at most


@dataclass(frozen=True, slots=True)
class Wait:
    """One request's wait at a step."""

    steps: int  # steps since it was last scheduled (or since it arrived)
    exact: bool  # False: it was waiting before the first digested step (at least `steps`)
    time_ns: int | None  # time since the end of the step it was last scheduled in (None: unknown)
    reasons: tuple[tuple[str, int], ...]  # (reason, steps), most steps first


class _Entry:
    """One waiting request's run so far (mutable while the book walks digests)."""

    __slots__ = ("since", "since_ns", "exact", "counts")

    def __init__(self, since: int, since_ns: int | None, exact: bool) -> None:
        self.since = since  # the last step that scheduled it (or the one before it arrived)
        self.since_ns = since_ns  # when that step ended
        self.exact = exact
        self.counts: dict[int, int] = {}

    def copy(self) -> _Entry:
        e = _Entry(self.since, self.since_ns, self.exact)
        e.counts = dict(self.counts)
        return e


class WaitBook:
    """The waits at one step, carried forward digest by digest: a step forwards costs one
    digest, a step back to a step seen lately nothing, a jump a walk back over the
    digests there are (at most MAX_WALK)."""

    def __init__(self, kept: int = 64) -> None:
        self._step: int | None = None  # the step the entries are for
        self._first = 0  # the first step of the run of digests they were built from
        self._entries: dict[int, _Entry] = {}
        self._kept: OrderedDict[int, tuple[int, dict[int, _Entry]]] = OrderedDict()
        self._max_kept = kept

    def at(self, step: int, get: Callable[[int], Digest | None]) -> dict[int, Wait]:
        """The waits after `step`, by ref; `get(s)`: the digest of step s, if made."""
        if get(step) is None:
            return {}
        old = self._kept.get(step)
        if old is not None and self._longer(old[0], step, get):
            old = None  # more history has been digested since: build it again
        if old is not None:
            self._first, entries = old
            self._entries = {ref: e.copy() for ref, e in entries.items()}
            self._step = step
        else:
            at = self._step
            if (
                at is None
                or at > step
                or self._longer(self._first, step, get)
                or any(get(s) is None for s in range(at + 1, step + 1))
            ):
                first = step
                while step - first < MAX_WALK and get(first - 1) is not None:
                    first -= 1
                self._first, self._entries, at = first, {}, first - 1
            prev = get(at)
            prev_ns = prev.time_ns if prev is not None else None
            for s in range(at + 1, step + 1):
                d = get(s)
                assert d is not None
                self._apply(d, prev_ns)
                prev_ns = d.time_ns
            self._step = step
            self._kept[step] = (self._first, {ref: e.copy() for ref, e in self._entries.items()})
            while len(self._kept) > self._max_kept:
                self._kept.popitem(last=False)
        self._kept.move_to_end(step)
        now = get(step)
        now_ns = now.time_ns if now is not None else None
        return {ref: self._wait(e, step, now_ns) for ref, e in self._entries.items()}

    @staticmethod
    def _longer(first: int, step: int, get: Callable[[int], Digest | None]) -> bool:
        """Whether a book built from `first` could now start earlier."""
        return step - first < MAX_WALK and get(first - 1) is not None

    def _apply(self, d: Digest, prev_ns: int | None) -> None:
        old = self._entries
        new: dict[int, _Entry] = {}
        for ref, code in d.unscheduled:
            e = old.get(ref)
            if e is None:
                # Scheduled in the step before, or arrived in this one: exact, unless this
                # is the first step the book sees (it may have been waiting for long).
                e = _Entry(d.step - 1, prev_ns, d.step > self._first)
            e.counts[code] = e.counts.get(code, 0) + 1
            new[ref] = e
        self._entries = new

    @staticmethod
    def _wait(e: _Entry, step: int, now: int | None) -> Wait:
        reasons = sorted(e.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return Wait(
            step - e.since,
            e.exact,
            None if now is None or e.since_ns is None else max(0, now - e.since_ns),
            tuple((WAIT_LABELS.get(code, f"reason {code}"), n) for code, n in reasons),
        )


def breakdown(w: Wait) -> str:
    """ "47 steps no free KV, 10 behind the queue head, 3 token budget"."""
    parts = [f"{n} {'step' if n == 1 else 'steps'} {why}" for why, n in w.reasons]
    return ", ".join(parts)
