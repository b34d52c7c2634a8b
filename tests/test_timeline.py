"""Timeline: any step's state, by jumping or by stepping, equals the live engine's."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from engine.records import Snapshot, Status
from engine.sim.api import demo_workload_path
from engine.sim.workload import load_workload
from replays.reducer import apply
from replays.state import Inconsistent, State
from replays.timeline import Timeline
from tests.helpers import Recorded, open_reader, record, req, workload, write_trace


def same(state: State, engine_state: Snapshot) -> bool:
    return state.to_snapshot() == engine_state


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorded, Path]:
    run = record(load_workload(demo_workload_path()), snapshot_interval=32)
    return run, write_trace(tmp_path_factory.mktemp("tl"), run.data)


def test_jumping_to_random_steps_matches_the_engine(demo: tuple[Recorded, Path]) -> None:
    run, path = demo
    tl = Timeline(open_reader(path), keyframe_interval=8, max_keyframes=6)
    rng = random.Random(1)
    for step in [rng.randrange(tl.num_steps) for _ in range(60)] + [0, tl.last_step]:
        assert same(tl.state(step), run.states[step]), step


def test_stepping_from_zero_matches_jumping(demo: tuple[Recorded, Path]) -> None:
    run, path = demo
    walker = Timeline(open_reader(path))
    jumper = Timeline(open_reader(path), keyframe_interval=1000, max_keyframes=1)
    rng = random.Random(2)
    targets = set(rng.sample(range(walker.num_steps), 15))
    for step in range(walker.num_steps):
        walked = walker.state(step)
        if step in targets:
            assert walked.to_snapshot() == jumper.state(step).to_snapshot()
            assert same(walked, run.states[step])


def test_back_n_after_forward_n_is_the_identical_state(demo: tuple[Recorded, Path]) -> None:
    _, path = demo
    tl = Timeline(open_reader(path), keyframe_interval=8, max_keyframes=4)
    start = 40
    before = tl.state(start).to_snapshot()
    for step in range(start + 1, start + 30):
        tl.state(step)
    for step in range(start + 29, start - 1, -1):
        tl.state(step)
    assert tl.state(start).to_snapshot() == before


def test_view_spells_out_the_step(demo: tuple[Recorded, Path]) -> None:
    run, path = demo
    tl = Timeline(open_reader(path))
    for step in (0, 5, 60, tl.last_step):
        view = tl.view(step)
        result = run.results[step]
        assert [(view.names[s.ref], s.num_tokens) for s in view.scheduled] == [
            (result.names[s.ref], s.num_tokens) for s in result.report.scheduled
        ]
        assert same(tl.state(step), run.states[step])


def test_step_at_time_and_bounds(demo: tuple[Recorded, Path]) -> None:
    _, path = demo
    tl = Timeline(open_reader(path))
    for step in (0, 17, tl.last_step):
        assert tl.step_at_time(tl.time_ns(step)) == step
    with pytest.raises(IndexError):
        tl.state(tl.last_step + 1)


def test_memory_is_bounded_by_the_caches(demo: tuple[Recorded, Path]) -> None:
    _, path = demo
    tl = Timeline(open_reader(path), keyframe_interval=2, max_keyframes=5, max_cached_records=10)
    for step in range(tl.num_steps):
        tl.state(step)
    assert len(tl._keyframes) <= 5 and len(tl._records) <= 10


def test_live_timeline_picks_up_appended_records(tmp_path: Path) -> None:
    run = record(workload([req("a", 40, 30), req("b", 20, 30, arrival_step=3)]))
    data = run.data
    path = tmp_path / "live.trace"
    cut = len(data) // 2
    path.write_bytes(data[:cut])
    tl = Timeline(open_reader(path), live=True)
    seen = tl.num_steps
    assert 0 < seen < len(run.states) and tl.cut is None
    with open(path, "ab") as f:
        f.write(data[cut:])
    assert tl.refresh() == len(run.states) - seen
    assert tl.finished
    assert same(tl.state(tl.last_step), run.states[-1])


def test_a_view_that_fails_leaves_the_timeline_usable(
    demo: tuple[Recorded, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """view() moves the working state on in place; a step that cannot be applied must not
    leave a half-applied state behind."""
    import replays.timeline as timeline_module
    from replays.state import Inconsistent

    run, path = demo
    tl = Timeline(open_reader(path), keyframe_interval=8)
    tl.state(30)

    def broken(state: State, *args: object) -> None:
        state.requests.clear()  # half-way through, then it gives up
        raise Inconsistent("broken")

    monkeypatch.setattr(timeline_module, "apply_with_view", broken)
    with pytest.raises(Inconsistent):
        tl.view(31)
    monkeypatch.undo()
    assert same(tl.state(30), run.states[30])
    assert same(tl.state(31), run.states[31])
    tl.view(32)
    assert same(tl.state(32), run.states[32])


def test_a_walk_back_after_a_jump_past_a_snapshot_reads_no_snapshot(tmp_path: Path) -> None:
    """A jump lands just after a snapshot; the steps before the target still get keyframes
    (the start is a snapshot before them), so walking back over the snapshot is cheap."""
    w = workload([req(f"r{i}", 30, max_tokens=200, arrival_step=i) for i in range(6)])
    run = record(w, snapshot_interval=64, snapshot_work=0)
    tl = Timeline(open_reader(write_trace(tmp_path, run.data)))
    assert tl.last_step >= 128 + 64
    snapshot_reads: list[int] = []
    read_at = tl.reader.read_at

    def counting(offset: int) -> object:
        entry = read_at(offset)
        if isinstance(entry.record, Snapshot):
            snapshot_reads.append(entry.record.step)
        return entry

    tl.reader.read_at = counting  # type: ignore[method-assign]
    target = 127 + 5  # five steps after the snapshot of step 127
    assert same(tl.state(target), run.states[target])
    assert snapshot_reads == [63]  # the one before the stretch the walk back covers
    for step in range(target - 1, target - 40, -1):
        assert same(tl.state(step), run.states[step]), step
    assert snapshot_reads == [63]


def test_a_seek_leaves_no_young_objects_for_the_collector(demo: tuple[Recorded, Path]) -> None:
    """What a seek builds and keeps goes to the oldest generation unscanned: the young
    generation's count is where the seek found it (0 after the freeze), not tens of
    thousands of objects for the next allocation to scan."""
    import gc

    _, path = demo
    tl = Timeline(open_reader(path))
    tl.state(tl.last_step)
    assert gc.isenabled()
    assert gc.get_count()[0] < 50


def _parts(state: State) -> tuple[object, ...]:
    """Everything a state holds, in a form that compares by value (the free queue in
    order, the requests in the dict's order)."""
    return (
        state.to_snapshot(),
        list(state.requests),
        list(state.ref_cnts),
        list(state.block_hashes.items()),
        list(state.free),
        state.policy,
        state.num_blocks,
        state.block_size,
    )


def test_a_keyframe_restores_the_state_it_was_taken_from(demo: tuple[Recorded, Path]) -> None:
    run, path = demo
    tl = Timeline(open_reader(path))
    for step in (0, 9, 33, 64, tl.last_step):
        state = tl.state(step)
        frame = state.keyframe()
        restored = frame.state()
        assert _parts(restored) == _parts(state)
        assert same(restored, run.states[step])
        assert _parts(state.copy()) == _parts(state)


def test_a_keyframe_shares_nothing_with_the_states_it_makes(
    demo: tuple[Recorded, Path],
) -> None:
    """A keyframe is used again and again: what a restored state does to itself (the
    reducer changes it in place) must not reach the keyframe, nor the state it was
    taken from."""
    run, path = demo
    tl = Timeline(open_reader(path))
    step = 40
    state = tl.state(step)
    frame = state.keyframe()
    before = _parts(state)
    restored = frame.state()
    for s in range(step + 1, step + 6):
        apply(restored, tl.record(s))
    assert same(restored, run.states[step + 5])
    assert _parts(frame.state()) == before == _parts(state)
    state.requests.clear()
    state.block_hashes.clear()
    state.ref_cnts[1] += 1
    assert _parts(frame.state()) == before


def test_keyframes_on_a_jump_and_on_the_walk_back_match_the_engine(
    demo: tuple[Recorded, Path],
) -> None:
    """A jump keeps keyframes near its target; a walk back starts from them."""
    run, path = demo
    tl = Timeline(open_reader(path), keyframe_interval=4)
    target = tl.last_step - 3
    assert same(tl.state(target), run.states[target])
    assert tl._keyframes
    for step in range(target - 1, target - 60, -1):
        assert same(tl.state(step), run.states[step]), step


def test_from_snapshot_rebuilds_and_raises_for_the_first_bad_request(
    demo: tuple[Recorded, Path],
) -> None:
    """from_snapshot checks a snapshot's requests in C passes first; when they find
    something wrong, the request-by-request loop names the first bad request, as before."""
    _, path = demo
    tl = Timeline(open_reader(path))
    step = next(s for s in range(tl.num_steps) if len(tl.state(s).requests) >= 3)
    snap = tl.state(step).to_snapshot()
    header = tl.header
    assert State.from_snapshot(header, snap).to_snapshot() == snap
    a, b, c = snap.requests[:3]
    n = header.num_blocks

    def bad(*requests: object, **fields: object) -> str:
        with pytest.raises(Inconsistent) as e:
            State.from_snapshot(
                header, replace(snap, requests=(*requests, *snap.requests[3:]), **fields)
            )  # type: ignore[arg-type]
        return str(e.value)

    assert bad(a, b, replace(c, ref=a.ref)) == f"snapshot: bad or repeated ref {a.ref}"
    assert bad(a, b, c, next_ref=c.ref) == f"snapshot: bad or repeated ref {c.ref}"
    assert bad(a, replace(b, status=Status.FINISHED_STOPPED), c) == (
        f"request {b.ref} has finished status {Status.FINISHED_STOPPED}"
    )
    assert bad(a, b, replace(c, block_ids=(*c.block_ids, n))) == (
        f"block {n} is outside the pool 1..{n - 1}"
    )
    assert bad(replace(a, block_ids=(0,)), b, c) == f"block 0 is outside the pool 1..{n - 1}"
    # Two things wrong: the first request's is named.
    assert bad(replace(a, block_ids=(n + 5,)), b, replace(c, ref=b.ref)) == (
        f"block {n + 5} is outside the pool 1..{n - 1}"
    )
    assert bad(a, replace(b, ref=a.ref), replace(c, block_ids=(-1,))) == (
        f"snapshot: bad or repeated ref {a.ref}"
    )
