"""Breakpoints land on the exact step, forwards and backwards: checked against a
brute-force scan of the engine's own reports."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.request import Status
from engine.sim.api import demo_workload_path
from engine.sim.workload import load_workload
from recorder.reader import TraceReader
from replays.breakpoints import Predicate, find, find_all, parse
from replays.timeline import Timeline
from tests.helpers import Recorded, open_reader, record, write_trace


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Recorded, Timeline]]:
    run = record(load_workload(demo_workload_path()), snapshot_interval=40)
    path = write_trace(tmp_path_factory.mktemp("bp"), run.data)
    with Timeline(TraceReader(path), keyframe_interval=8, max_keyframes=8) as tl:
        yield run, tl


def brute(run: Recorded, tl: Timeline, p: Predicate) -> list[int]:
    """Where `p` holds, from the engine's reports and states (no reducer involved)."""
    hits = []
    arrived: dict[str, int] = {}
    admitted: set[str] = set()
    tokened: set[str] = set()
    prev_t = 0
    held = False  # a watchpoint's condition at the step before
    for i, (result, state) in enumerate(zip(run.results, run.states)):
        rep, names = result.report, result.names
        sampled = result.sampled()
        for a in rep.arrivals:
            arrived[a.request_id] = i
        admitted |= {names[a.ref] for a in rep.admissions}
        t = tl.record(i).time_ns
        k, req, v = p.kind, p.request, p.value
        if k == "preempt":
            hit = bool(rep.preemptions) and (
                req is None or any(names[x.victim] == req for x in rep.preemptions)
            )
        elif k == "admit":
            hit = any(names[a.ref] == req for a in rep.admissions)
        elif k == "finish":
            hit = any(names[f.ref] == req for f in rep.finishes)
        elif k == "first-token":
            hit = req in sampled and req not in tokened
            tokened |= set(sampled)
        elif k == "free":
            hit = rep.free_blocks < v
        elif k == "slow":
            hit = tl.record(i).duration_ns(prev_t) / 1e6 > v
        elif k == "util":
            hit = 100 * rep.num_scheduled_tokens / rep.token_budget < v
        else:
            ids = [names[r] for r in state.waiting]
            hit = any(r not in admitted and i - arrived[r] > v for r in ids)
        prev_t = t
        if p.edge:
            hit, held = hit and not held, hit
        if hit:
            hits.append(i)
    return hits


SPECS = [
    "preempt",
    "preempt:req-18",
    "admit:req-05",
    "first-token:req-12",
    "finish:req-09",
    "free<10",
    "wait>20",
    "util<50",
    "slow>0.05",
    "while free<10",
    "while wait>20",
    "while util<50",
]


@pytest.mark.parametrize("spec", SPECS)
def test_find_lands_on_the_brute_force_steps(demo: tuple[Recorded, Timeline], spec: str) -> None:
    run, tl = demo
    p = parse(spec)
    want = brute(run, tl, p)
    assert list(find_all(tl, [p])) == want
    if spec not in ("slow>0.05",):
        assert want, f"{spec}: the demo should exercise it"
    rng = random.Random(spec)
    for start in [rng.randrange(-1, tl.num_steps) for _ in range(12)] + [-1, tl.last_step]:
        nxt = next((s for s in want if s > start), None)
        prev = next((s for s in reversed(want) if s < start), None)
        assert find(tl, [p], start) == nxt, (spec, start)
        assert find(tl, [p], start, backward=True) == prev, (spec, start)


def test_a_search_in_slices_finds_what_one_search_finds(demo: tuple[Recorded, Timeline]) -> None:
    """The TUI searches long traces in slices (`limit`) to stay responsive."""
    run, tl = demo
    for spec in ("preempt", "first-token:req-12", "wait>20", "free<10", "while util<50"):
        p = parse(spec)
        want = brute(run, tl, p)
        for start in (-1, 30, 80, tl.last_step):
            for backward in (False, True):
                at, found = start, None
                while found is None:
                    limit = at - 7 if backward else at + 7
                    found = find(tl, [p], at, backward=backward, limit=limit)
                    if limit <= tl.first_step or limit >= tl.last_step:
                        break
                    at = limit
                assert found == find(tl, [p], start, backward=backward), (spec, start)
                expect = (
                    next((s for s in reversed(want) if s < start), None)
                    if backward
                    else next((s for s in want if s > start), None)
                )
                assert found == expect


def test_a_watchpoint_hits_once_per_transition(demo: tuple[Recorded, Timeline]) -> None:
    """`free<10` hits where the pool drops below 10, not at every step below it; `while`
    keeps the old meaning."""
    _, tl = demo
    below = [s for s in range(tl.first_step, tl.last_step + 1) if tl.record(s).free_blocks < 10]
    drops = [s for s in below if s == tl.first_step or tl.record(s - 1).free_blocks >= 10]
    assert len(drops) < len(below)  # the demo stays below 10 for more than one step
    assert list(find_all(tl, [parse("free<10")])) == drops
    assert list(find_all(tl, [parse("while free<10")])) == below
    assert str(parse("while  free < 10")) == "while free<10"
    with pytest.raises(ValueError, match="while"):
        parse("while preempt")


def test_several_breakpoints_stop_at_the_nearest(demo: tuple[Recorded, Timeline]) -> None:
    run, tl = demo
    ps = [parse("finish:req-00"), parse("preempt")]
    want = sorted(set(brute(run, tl, ps[0])) | set(brute(run, tl, ps[1])))
    assert list(find_all(tl, ps)) == want
    assert find(tl, ps, want[0]) == want[1]


def test_first_token_that_also_finishes(tmp_path: Path) -> None:
    from tests.helpers import req, workload

    run = record(workload([req("one", 20, 1), req("two", 20, 5)]))
    tl = Timeline(open_reader(write_trace(tmp_path, run.data)))
    assert list(find_all(tl, [parse("first-token:one")])) == [0]
    assert run.reports[0].finishes[0].status == Status.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus", "unknown"),
        ("admit", "needs a request id"),
        ("free<x", "unknown"),
        ("preempt:", "empty request id"),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_spellings_round_trip() -> None:
    for spec in SPECS:
        assert str(parse(spec)) == spec
