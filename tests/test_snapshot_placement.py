"""Where snapshots land: by replay work as well as by step count (docs/trace-format.md,
section 1), and a seek from any of them gives the state that stepping from the start gives."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from recorder.reader import TraceReader
from recorder.recorder import (
    MIN_BUDGET_STEPS,
    MIN_SNAPSHOT_WORK,
    SNAPSHOT_WORK_PER_BLOCK,
    Recorder,
    RecorderOptions,
)
from recorder.schema import FORMAT_MAJOR, Snapshot, Step
from recorder.writer import MemoryWriter
from replays.reducer import replay
from replays.resim import resimulate
from replays.timeline import Timeline
from tests.helpers import (
    Recorded,
    make_engine,
    open_reader,
    record,
    req,
    workload,
    write_trace,
)

BUDGET = 300  # replay work between snapshots in these tests


def heavy() -> Recorded:
    """Twelve requests decoding together: each step is a dozen units of work or more."""
    reqs = [req(f"h{i}", 40 + 8 * i, max_tokens=120, arrival_step=i) for i in range(12)]
    return record(workload(reqs), snapshot_interval=1000, snapshot_work=BUDGET)


def light() -> Recorded:
    """One request decoding alone: about two units a step, so the step count decides."""
    return record(
        workload([req("solo", 20, max_tokens=200)]), snapshot_interval=50, snapshot_work=BUDGET
    )


def work_of(step: Step) -> int:
    """The documented unit: one per step, scheduled request, block moved, arrival,
    finish and preemption (written out here, not taken from the recorder)."""
    return (
        1
        + step.num_decodes
        + len(step.scheduled)
        + len(step.kv_events.block_ids)
        + len(step.arrivals)
        + len(step.finishes)
        + len(step.preemptions)
    )


def expected_snapshots(steps: list[Step], interval: int, budget: int) -> list[int]:
    out, work, count = [], 0, 0
    for s in steps:
        work += work_of(s)
        count += 1
        if count >= interval or work >= budget:
            out.append(s.step)
            work = count = 0
    return out


def snapshots_and_steps(path: Path) -> tuple[list[int], list[Step]]:
    with TraceReader(path) as reader:
        records = [e.record for e in reader.entries()]
        assert reader.index().snapshot_steps == tuple(
            r.step for r in records if isinstance(r, Snapshot)
        )
    return (
        [r.step for r in records if isinstance(r, Snapshot)],
        [r for r in records if isinstance(r, Step)],
    )


@pytest.fixture(scope="module")
def heavy_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorded, Path]:
    run = heavy()
    return run, write_trace(tmp_path_factory.mktemp("heavy"), run.data)


def test_heavy_steps_place_snapshots_by_work(heavy_trace: tuple[Recorded, Path]) -> None:
    _, path = heavy_trace
    snaps, steps = snapshots_and_steps(path)
    assert snaps == expected_snapshots(steps, 1000, BUDGET)
    assert len(snaps) >= 4  # the step cap (1000) never came into it
    gaps = [b - a for a, b in zip([-1, *snaps], snaps)]
    assert max(gaps) < 40  # a dozen requests' work reaches the budget within a few dozen steps


def test_light_steps_place_snapshots_by_step_count(tmp_path: Path) -> None:
    path = write_trace(tmp_path, light().data)
    snaps, steps = snapshots_and_steps(path)
    assert snaps == expected_snapshots(steps, 50, BUDGET)
    assert snaps == list(range(49, len(steps), 50))  # the budget was never reached


def test_a_seek_from_a_work_placed_snapshot_equals_stepping_from_the_start(
    heavy_trace: tuple[Recorded, Path],
) -> None:
    run, path = heavy_trace
    with TraceReader(path) as reader:
        # Stepping from the start checks each snapshot against the steps before it.
        walked = [s.to_snapshot() for s in replay(reader.header, reader.entries())]
    assert walked == run.states
    tl = Timeline(open_reader(path), max_keyframes=2)
    rng = random.Random(5)
    for step in rng.sample(range(tl.num_steps), 40) + [tl.last_step]:
        assert tl.state(step).to_snapshot() == walked[step], step


def test_the_default_budget_scales_with_the_pool(tmp_path: Path) -> None:
    for num_blocks in (1000, 20_000):
        run = record(workload([req("a", 20)], num_blocks=num_blocks))
        with TraceReader(write_trace(tmp_path, run.data)) as reader:
            header = reader.header
        assert header.snapshot_work == max(MIN_SNAPSHOT_WORK, SNAPSHOT_WORK_PER_BLOCK * num_blocks)


def test_resimulation_places_snapshots_where_the_recording_did(
    heavy_trace: tuple[Recorded, Path], tmp_path: Path
) -> None:
    _, path = heavy_trace
    out = tmp_path / "resim.trace"
    result = resimulate(path, out=out)
    assert result.reproduced, result.divergence
    assert snapshots_and_steps(out)[0] == snapshots_and_steps(path)[0]


def test_a_1_1_trace_without_snapshot_work_still_opens_and_seeks(tmp_path: Path) -> None:
    """Before 1.2 the header had no snapshot_work (key 11): a writer that leaves it at 0
    writes exactly such a header; with the 1.1 preamble it is byte for byte an old trace."""
    run = record(
        workload([req(f"r{i}", 30, max_tokens=80) for i in range(6)]),
        snapshot_interval=16,
        snapshot_work=0,
    )
    data = bytearray(run.data)
    data[8:12] = FORMAT_MAJOR.to_bytes(2, "little") + (1).to_bytes(2, "little")
    path = write_trace(tmp_path, data)
    with TraceReader(path) as reader:
        assert reader.header.snapshot_work == 0
        assert reader.index().snapshot_steps == tuple(range(15, len(run.states), 16))
    tl = Timeline(open_reader(path))
    for step in (0, 17, 40, tl.last_step):
        assert tl.state(step).to_snapshot() == run.states[step]


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_work=-1"):
        record(workload([req("a", 20)]), snapshot_work=-1)


def expected_by_budget(steps: list[Step], interval: int, budget: float, cost: int) -> list[int]:
    """Snapshot placement by cost, written out: at most `interval` steps apart, and at
    least MIN_BUDGET_STEPS apart once the steps' engine time since the last pays for the
    last snapshot's `cost` at `budget` (the first has no cost to pay for)."""
    out: list[int] = []
    count = engine_ns = due = 0
    for s in steps:
        count += 1
        if count < interval:
            engine_ns += s.schedule_ns + s.update_ns
        if count >= interval or (count >= MIN_BUDGET_STEPS and engine_ns >= due):
            out.append(s.step)
            count = engine_ns = 0
            due = int(cost / budget)
    return out


def budgeted(cost: int, interval: int) -> Recorded:
    """Four requests decoding for ~400 steps; each snapshot "costs" `cost` ns of CPU."""
    ticks = itertools.count(0, cost)
    reqs = [req(f"b{i}", 24, max_tokens=400) for i in range(4)]
    return record(
        workload(reqs),
        snapshot_interval=interval,
        snapshot_work=0,
        snapshot_budget=0.01,
        cpu_clock=lambda: next(ticks),
    )


@pytest.mark.parametrize("cost", [1, 2_000_000, 10**12])
def test_a_budget_places_snapshots_by_their_cost(tmp_path: Path, cost: int) -> None:
    path = write_trace(tmp_path, budgeted(cost, interval=300).data)
    snaps, steps = snapshots_and_steps(path)
    assert snaps == expected_by_budget(steps, 300, 0.01, cost)
    gaps = [b - a for a, b in zip([-1, *snaps], snaps)]
    assert min(gaps) >= MIN_BUDGET_STEPS
    if cost == 1:  # free snapshots: as often as allowed
        assert gaps[:3] == [MIN_BUDGET_STEPS] * 3
    if cost == 10**12:  # never affordable after the first: the step cap places the rest
        assert gaps[1:] and all(g == 300 for g in gaps[1:])


def test_a_budget_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_budget"):
        Recorder(
            make_engine(workload([req("x", 8)])),
            MemoryWriter(),
            RecorderOptions(snapshot_budget=1.5),
        )


@pytest.mark.parametrize("step_cpu", [1_000, 500, 330])
def test_a_budget_clock_places_snapshots_by_the_engines_cpu_time(
    tmp_path: Path, step_cpu: int
) -> None:
    """recorder.vllm's placement: the engine thread's CPU time between steps (a fake clock
    that advances `step_cpu` a step here), not the steps' schedule_ns + update_ns (wall
    time, which a loaded machine stretches), pays for the snapshots."""
    cost = 1_000  # each snapshot's CPU time: at a 1% budget, 100,000 ns of engine time
    snapshot_ticks = itertools.count(0, cost)
    engine_ticks = itertools.count(0, step_cpu)  # read once a step, and after a snapshot
    reqs = [req(f"c{i}", 24, max_tokens=400) for i in range(4)]
    run = record(
        workload(reqs),
        snapshot_interval=1000,
        snapshot_work=0,
        snapshot_budget=0.01,
        cpu_clock=lambda: next(snapshot_ticks),
        budget_clock=lambda: next(engine_ticks),
    )
    snaps, steps = snapshots_and_steps(write_trace(tmp_path, run.data))
    assert len(steps) > 350
    # The first has no cost to pay for; then one each time the CPU time has paid for it.
    gap = max(MIN_BUDGET_STEPS, -(-cost * 100 // step_cpu))
    last = steps[-1].step
    assert snaps == list(range(MIN_BUDGET_STEPS - 1, last + 1, gap))
    assert len(snaps) >= 2
    # The steps' own times would have placed them elsewhere.
    assert snaps != expected_by_budget(steps, 1000, 0.01, cost)
