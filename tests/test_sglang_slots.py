"""Format 1.9 without SGLang: a token pool slot by slot (issue 29, item 3). The reducer
rebuilds each request's slots, the free ones and the radix cache's from a synthetic SGLang
trace (tests/sglang_slots.py); older traces read as before; the TUI draws the pool."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
from textual.pilot import Pilot

from recorder.codec import decode, encode
from recorder.reader import TraceReader
from recorder.schema import RecordType, Step
from replays.reducer import apply
from replays.slots import SlotsInconsistent, expand, to_runs
from replays.state import State
from tests import sglang_slots
from tests.tui_support import at_step, make_app, wait_until
from tui.viewmodel import CACHED, FREE, NULL, SHARED, USED, _blocks
from tui.widgets.blockmap import BlockMap
from tui.widgets.detail import BlockDetail

SLOTS = 64
P = 8  # prompt tokens


def states(slots: int = SLOTS) -> list[State]:
    state = State.initial(sglang_slots.header(slots))
    out = []
    for step in sglang_slots.steps(slots, P):
        apply(state, step)
        out.append(state.copy())
    return out


def test_runs_round_trip() -> None:
    assert to_runs([3, 4, 5, 9, 2, 3]) == (3, 3, 9, 1, 2, 2)
    assert expand((3, 3, 9, 1, 2, 2), 10) == [3, 4, 5, 9, 2, 3]
    with pytest.raises(SlotsInconsistent, match="outside the pool"):
        expand((1, 1 << 60), 10)  # a hostile run is refused before it is expanded
    assert to_runs([]) == ()


def test_the_reducer_rebuilds_every_slot() -> None:
    after = states()
    pool = after[0].slots
    assert pool is not None
    assert pool.rows == {0: list(range(1, P + 1)), 1: list(range(P + 1, 2 * P + 1))}
    assert pool.num_free == SLOTS - 2 * P
    # 2: r0 finished; its slots are neither free nor anybody's: the radix cache's
    pool = after[2].slots
    assert pool is not None and 0 not in pool.rows
    assert pool.evictable == P + 1 and pool.num_free == SLOTS - 2 * P - 3
    # 3: r2's prefix is r0's prompt (the cache's slots), then its own
    pool = after[3].slots
    assert pool is not None
    assert pool.rows[2] == [*range(1, P + 1), *range(2 * P + 4, 2 * P + 8)]
    vm = _blocks(after[3])
    assert vm.pool == "tokens" and vm.num_blocks == SLOTS + 1
    assert vm.cls[0] == NULL and vm.cls[1] == USED and vm.owner[1] == 2
    assert vm.cls[2 * P + 1] == CACHED  # r0's last token: evictable
    assert vm.cls[P + 1] == USED and vm.owner[P + 1] == 1
    assert vm.cls[SLOTS] == FREE
    # 4: the evicted slot went to r1's decode
    pool = after[4].slots
    assert pool is not None and pool.rows[1][-1] == 2 * P + 1 and pool.evictable == 0
    # 5: r1 retracted: its slots are free again, one of them r2's next
    pool = after[5].slots
    assert pool is not None and set(pool.rows) == {2}
    assert pool.rows[2][-1] == P + 1
    assert pool.num_free == SLOTS - (P + 6)


def test_shared_slots_are_drawn_shared() -> None:
    state = states()[0]
    assert state.slots is not None
    state.slots.rows[1][:2] = [1, 2]  # as if r1 had hit r0's first two tokens
    vm = _blocks(state)
    assert vm.cls[1] == SHARED and vm.owners[1] == (0, 1)


def test_a_step_that_does_not_fit_its_pool_is_an_error() -> None:
    state = State.initial(sglang_slots.header(SLOTS))
    first = sglang_slots.steps(SLOTS, P)[0]
    with pytest.raises(SlotsInconsistent, match="free slots, the record says"):
        apply(state.copy(), replace(first, free_slots=first.free_slots + 1))
    with pytest.raises(SlotsInconsistent, match="slots allocated for"):
        apply(state.copy(), replace(first, slot_allocs=(1, 3)))
    apply(state, first)
    with pytest.raises(SlotsInconsistent, match="not free"):  # slot 1 is r0's
        apply(state.copy(), replace(sglang_slots.steps(SLOTS, P)[1], slot_allocs=(1, 2)))


def test_snapshots_hold_the_pool(tmp_path: Path) -> None:
    state = states()[3]
    snap = state.to_snapshot()
    back = decode(RecordType.SNAPSHOT, encode(snap)[1], 0)
    assert back == snap
    again = State.from_snapshot(sglang_slots.header(SLOTS), snap)
    assert again.slots == state.slots


def test_a_keyframe_holds_the_pool() -> None:
    """A Timeline keyframe restores the token pool too, and shares none of it: the
    state restored from it moves on without changing the keyframe."""
    after = states()
    steps = sglang_slots.steps(SLOTS, P)
    for i, state in enumerate(after[:-1]):
        frame = state.keyframe()
        restored = frame.state()
        assert restored.slots == state.slots and restored.slots is not state.slots
        assert restored.to_snapshot() == state.to_snapshot()
        apply(restored, steps[i + 1])
        assert restored.slots == after[i + 1].slots
        assert frame.state().to_snapshot() == state.to_snapshot()


def test_older_traces_read_unchanged() -> None:
    """A 1.8 header (no slot_map) and steps without the slot keys: no slot map."""
    body = msgpack.unpackb(encode(sglang_slots.header(SLOTS))[1], strict_map_key=False)
    del body[14]
    old = decode(RecordType.HEADER, msgpack.packb(body), 0)
    assert old is not None and not old.slot_map  # type: ignore[union-attr]
    state = State.initial(old)  # type: ignore[arg-type]
    assert state.slots is None
    plain = Step(step=0, free_blocks=SLOTS, free_slots=SLOTS)
    apply(state, plain)
    assert _blocks(state).pool == "blocks"
    # and the new keys cost nothing where they are at their defaults
    assert set(msgpack.unpackb(encode(plain)[1], strict_map_key=False)) <= set(range(30))


def test_a_written_trace_reads_back(tmp_path: Path) -> None:
    path = sglang_slots.write(tmp_path / "slots.trace", SLOTS, P)
    with TraceReader(path) as reader:
        assert reader.header.slot_map
        recs = [e.record for e in reader.entries() if isinstance(e.record, Step)]
    assert recs == sglang_slots.steps(SLOTS, P)


SIZE = (120, 40)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sglang_slots.write(tmp_path_factory.mktemp("slots") / "slots.trace", SLOTS, P)


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4096 slots: more than the pane has cells, so a cell stands for a run of slots."""
    return sglang_slots.write(tmp_path_factory.mktemp("slots") / "large.trace", 4096, 600)


def test_token_pool_map(snap_compare: Any, small: Path) -> None:
    """Step 3: r2's prefix shared with the radix cache's slots of r0, one evictable slot,
    r1's slots; slot 1 selected."""

    async def run_before(pilot: Pilot[None]) -> None:
        await at_step(pilot, 0)
        await pilot.press("g", "3", "enter")
        await at_step(pilot, 3)
        pilot.app.selected_block = 1
        blocks = pilot.app.query_one(BlockMap)
        await wait_until(pilot, lambda: blocks.selected == 1)

    assert snap_compare(make_app(small), terminal_size=SIZE, run_before=run_before)


def test_token_pool_map_aggregated(snap_compare: Any, large: Path) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await at_step(pilot, 0)
        await pilot.press("g", "3", "enter")
        await at_step(pilot, 3)
        detail = pilot.app.query_one(BlockDetail)
        await wait_until(pilot, lambda: detail.pool == "tokens" and detail.aggregate)

    assert snap_compare(make_app(large), terminal_size=SIZE, run_before=run_before)
