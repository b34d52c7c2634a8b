"""The engine's state at any step of a trace, forwards and backwards (docs/contracts.md R1).

State at step i is the reducer applied to the step records up to i. To reach any step fast
the Timeline starts from the nearest keyframe: the trace's own snapshots (on disk), and
compact copies (replays.state.Keyframe) of states it has built, every `keyframe_interval`
steps, kept in memory up to a bound (least recently used go first). The file is never
loaded whole: records are read by offset and a bounded cache keeps the recent ones, so
memory stays flat on traces larger than RAM.

A Timeline over a file that is still being written follows it: `refresh()` indexes the
records appended since the last call.
"""

from __future__ import annotations

import gc
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

from recorder.errors import TraceError
from recorder.reader import Cut, TraceReader
from recorder.schema import Header, Snapshot, Step
from replays.reducer import StepView, apply, apply_with_view
from replays.state import Keyframe, State

# Rough costs in units of "apply one step", to pick where to start from.
_COPY_COST = 5  # copying a keyframe
_LOAD_COST = 60  # decoding and validating a trace snapshot
_NEAR = 48  # steps before a jump's target that get keyframes (a walk back stays inside)


@contextmanager
def _no_gc_pauses() -> Iterator[None]:
    """Building a state allocates tens of thousands of objects (decoded records, keyframe
    copies) next to the long-lived keyframes; left on, the cyclic collector runs dozens of
    times per seek and scans the keyframes each time. Nothing built here forms cycles, so
    reference counting frees it all, and what survives the seek is long-lived: it goes
    straight to the oldest generation (freeze, then unfreeze: no scan, and the young
    generation's count starts again at 0). Merely re-enabling the collector would make the
    next allocation scan all of it at once (measured: up to 90 ms on a 16,320-block pool,
    most of a seek's p99). Cyclic garbage that other code left young is not lost: the next
    full collection still finds it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if was_enabled:
            gc.enable()


class Timeline:
    """Random access to the states of one trace.

    `state(i)` returns the state after step i; the object stays valid only until the
    next call on this Timeline (it is the working state, reused as the cursor moves):
    read it, don't keep it or change it. `first_step - 1` is the state before the first
    step (for a trace that starts at step 0)."""

    def __init__(
        self,
        reader: TraceReader,
        *,
        live: bool = False,
        keyframe_interval: int = 8,
        max_keyframes: int = 96,
        max_cached_records: int = 4096,
    ) -> None:
        if keyframe_interval < 1 or max_keyframes < 1:
            raise ValueError("keyframe_interval and max_keyframes must be >= 1")
        self.reader = reader
        self.header: Header = reader.header
        self.live = live
        self.keyframe_interval = keyframe_interval
        self.max_keyframes = max_keyframes
        self.max_cached_records = max_cached_records
        self.first_step = self.header.first_step
        index = reader.index() if not live else None
        if index is not None:
            self._offsets = list(index.step_offsets)
            self._snap_steps = list(index.snapshot_steps)
            self._snap_offsets = list(index.snapshot_offsets)
            self._scan_end: int | None = None  # a finished file is indexed once
            self.finished = reader.finished or reader.footer is not None
        else:
            self._offsets, self._snap_steps, self._snap_offsets = [], [], []
            self._scan_end = reader.records_start
            self.finished = False
            self.refresh()
        self._records: OrderedDict[int, Step] = OrderedDict()
        self._keyframes: OrderedDict[int, Keyframe] = OrderedDict()
        self._sorted_keys: list[int] | None = None  # the keyframes' steps, sorted
        self._cur: State | None = None
        self._cur_step = self.first_step - 2  # nothing built yet
        self._view: tuple[int, StepView] | None = None

    def close(self) -> None:
        """Close the trace file (the Timeline owns the reader it was given)."""
        self.reader.close()

    def __enter__(self) -> Timeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the trace's extent --------------------------------------------------------------------

    @property
    def last_step(self) -> int:
        """The last step in the trace so far (first_step - 1 when it has none)."""
        return self.first_step + len(self._offsets) - 1

    @property
    def num_steps(self) -> int:
        return len(self._offsets)

    @property
    def cut(self) -> Cut | None:
        """Where the file stops being whole, when its writer died mid-record."""
        return self.reader.cut

    def refresh(self) -> int:
        """Index the records a live writer appended since the last call; returns how many
        new steps there are."""
        if self._scan_end is None or self.finished:
            return 0
        found = self.reader.scan(self._scan_end, self.last_step + 1, tail=self.live)
        self._offsets += found.step_offsets
        self._snap_steps += found.snapshot_steps
        self._snap_offsets += found.snapshot_offsets
        self._scan_end = found.end
        self.finished = found.finished
        return len(found.step_offsets)

    # -- records ------------------------------------------------------------------------------

    def record(self, step: int) -> Step:
        """The step record of `step`."""
        rec = self._records.get(step)
        if rec is not None:  # only steps in the trace are cached: no _check needed
            self._records.move_to_end(step)
            return rec
        self._check(step)
        rec = cast(Step, self.reader.record_at(self._offsets[step - self.first_step]))
        if not isinstance(rec, Step) or rec.step != step:
            raise TraceError(
                f"the index says step {step} is here", self._offsets[step - self.first_step]
            )
        self._records[step] = rec
        if len(self._records) > self.max_cached_records:
            self._records.popitem(last=False)
        return rec

    def read_ahead(self, lo: int, hi: int) -> None:
        """Decode the records of steps lo..hi (clamped to the trace, and to half the
        record cache) into the cache, in one loop, stopping quietly at the first that
        cannot be read: record() then raises for it in its turn. A walk over a live
        batch decodes hundreds of records; decoding them back to back, rather than
        between applying one and digesting it, keeps the decoder's code and data in the
        CPU's caches (a steady step's decode took twice as long interleaved)."""
        lo = max(lo, self.first_step)
        hi = min(hi, self.last_step, lo + self.max_cached_records // 2 - 1)
        records, offsets, record_at = self._records, self._offsets, self.reader.record_at
        for step in range(lo, hi + 1):
            if step in records:
                continue
            try:
                rec = record_at(offsets[step - self.first_step])
            except TraceError:
                return
            if not isinstance(rec, Step) or rec.step != step:
                return
            records[step] = rec
        while len(records) > self.max_cached_records:
            records.popitem(last=False)

    def offset(self, step: int) -> int:
        """Where the step record of `step` starts in the file."""
        self._check(step)
        return self._offsets[step - self.first_step]

    def time_ns(self, step: int) -> int:
        """When `step` ended, in ns since the recording started."""
        return self.record(step).time_ns

    def step_at_time(self, t_ns: int) -> int:
        """The last step that ended at or before `t_ns` (the first step if none did)."""
        lo, hi = self.first_step, self.last_step
        if hi < lo:
            raise ValueError("the trace has no steps")
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.time_ns(mid) <= t_ns:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- states -------------------------------------------------------------------------------

    def state(self, step: int, keyframes: bool = True) -> State:
        """The state after `step` (valid until the next call on this Timeline).
        `keyframes=False`: keep no copy of the states built on the way (a walk over many
        steps that only needs the last few kept says so for the others)."""
        if step != self.first_step - 1:
            self._check(step)
        if self._cur is not None and self._cur_step == step:
            return self._cur
        if self._cur is not None and self._cur_step == step - 1:
            # The next step (a walk forwards, a live view following): the working state
            # is always the cheapest start, and one step allocates too little for the
            # collector to matter. _advance over one step, inline: a live view takes
            # this path for every step an engine writes.
            state, self._cur = self._cur, None  # until applied, the state is nobody's
            apply(state, self.record(step), self._offsets[step - self.first_step])
            if keyframes and step % self.keyframe_interval == 0 and step not in self._keyframes:
                self._keep(step, state.keyframe())
            self._cur, self._cur_step = state, step
            return state
        # Walking backwards (a short move back), the steps just before this one come next:
        # keep keyframes all the way from the start point, so each further step back is
        # short. A long jump back is a jump like any other.
        backward = 0 < self._cur_step - step <= _NEAR
        with _no_gc_pauses():
            state, at = self._start_for(step)
            self._advance(state, at, step, keep_all=backward, keep=keyframes)
        self._cur, self._cur_step = state, step
        return state

    def view(self, step: int) -> StepView:
        """Step `step` spelled out: every scheduled entry, the samples, the KV events."""
        if self._view is not None and self._view[0] == step:
            return self._view[1]
        # The working state moves on in place (no copy: a copy of a large state costs
        # more than the step). Until the step is applied it is nobody's: a record that
        # does not fit leaves it undefined, and the next call starts from a keyframe.
        state = self.state(step - 1)
        self._cur = None
        view = apply_with_view(state, self.record(step), self._offsets[step - self.first_step])
        self._cur, self._cur_step = state, step  # now the state after `step`
        self._view = (step, view)
        return view

    def _start_for(self, step: int) -> tuple[State, int]:
        """A private state at or before `step` to build it from, with its step: the
        cheapest of the working state, an in-memory keyframe and a trace snapshot."""
        options: list[tuple[int, str, int]] = []  # (cost, kind, at)
        if self._cur is not None and self._cur_step <= step:
            options.append((step - self._cur_step, "cur", self._cur_step))
        i = bisect_right(self._keyframe_steps(), step) - 1
        if i >= 0:
            at = self._keyframe_steps()[i]
            options.append((step - at + _COPY_COST, "key", at))
        j = self._snapshot_before(step)
        if j >= 0:
            at = self._snap_steps[j]
            options.append((step - at + _LOAD_COST, "snap", at))
        elif self.first_step == 0:
            options.append((step + 1 + _COPY_COST, "initial", -1))
        if not options:
            raise TraceError(
                f"the trace starts mid-run at step {self.first_step} and has "
                "no snapshot to start from"
            )
        _, kind, at = min(options)
        if kind == "cur":
            assert self._cur is not None
            state = self._cur
            self._cur = None  # it is about to move
            return state, at
        if kind == "key":
            self._keyframes.move_to_end(at)
            return self._keyframes[at].state(), at
        if kind == "snap":
            snap = self.reader.read_at(self._snap_offsets[j]).record
            assert isinstance(snap, Snapshot)
            state = State.from_snapshot(self.header, snap)
            self._keep(at, state.keyframe())
            return state, at
        return State.initial(self.header), -1

    def _snapshot_before(self, step: int) -> int:
        """The index of the trace snapshot to start `step` from (-1: none; start from the
        initial state if the trace has one). The last one at least _NEAR steps before it
        when there is one: the steps just before a jump's target get keyframes on the way,
        and a snapshot inside that stretch would leave the steps before it without any, so
        a walk back would cost a whole rebuild from the snapshot before (with snapshots
        ~144 steps apart, one walk in five of 30 steps back crossed one)."""
        j = bisect_right(self._snap_steps, step - _NEAR) - 1
        if j < 0 and self.first_step != 0:
            j = bisect_right(self._snap_steps, step) - 1  # no initial state to fall back on
        return j

    def _advance(
        self, state: State, at: int, step: int, keep_all: bool = False, keep: bool = True
    ) -> None:
        interval = self.keyframe_interval
        # Keyframes pay off near where the user is (stepping back, small jumps); on a long
        # jump, copying the state every `interval` steps of the way would cost more than
        # the jump itself, so only the last stretch before the target gets them.
        keep_from = at if keep_all else step - _NEAR
        # The records first, back to back (read_ahead: decoding them between applying
        # steps ran slower, each evicting the other's code and data from the CPU caches).
        self.read_ahead(at + 1, step)
        for s in range(at + 1, step + 1):
            apply(state, self.record(s), self._offsets[s - self.first_step])
            if keep and s % interval == 0 and s >= keep_from and s not in self._keyframes:
                self._keep(s, state.keyframe())

    def _keep(self, step: int, frame: Keyframe) -> None:
        self._keyframes[step] = frame
        self._keyframes.move_to_end(step)
        self._sorted_keys = None
        while len(self._keyframes) > self.max_keyframes:
            self._keyframes.popitem(last=False)

    def _keyframe_steps(self) -> list[int]:
        if self._sorted_keys is None:
            self._sorted_keys = sorted(self._keyframes)
        return self._sorted_keys

    def _check(self, step: int) -> None:
        if not 0 <= step - self.first_step < len(self._offsets):
            raise IndexError(
                f"step {step} is not in this trace ({self.first_step}..{self.last_step})"
            )
