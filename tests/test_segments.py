"""A server's flight recorder (recorder.serving): rotating segments kept under a bound,
each one a trace of its own, the run directory read as one trace by every command, and
incident extraction. The engine is the simulated one, driven in this process."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine.core import EngineCore
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload
from recorder.errors import TraceError
from recorder.info import summarize
from recorder.multi import SegmentedReader, open_trace
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions
from recorder.schema import Step
from recorder.segments import join, list_segments
from recorder.serving import MIN_MAX_BYTES, ServerRecording, open_server_recording
from recorder.writer import TraceWriter
from replays.diff import differing_fields
from replays.reducer import state_at
from replays.resim import ResimError, resimulate
from replays.stats import trace_stats
from replays.timeline import Timeline
from tests.helpers import workload
from tests.tui_support import app_test, at_step, make_app, submit
from tui.cli import main

STEP_NS = 1_000_000_000  # the fake clock: every step takes one second


# Requests enough for several segments of MIN_MAX_BYTES, so that the oldest get deleted.
ROTATING = 96


def busy_workload(n: int = 48, seed: int = 3) -> SimWorkload:
    """Shared prefixes, a tight pool: prefix hits, preemptions, many KV events."""
    rng = random.Random(seed)
    system = list(range(9000, 9048))
    requests = []
    for i in range(n):
        out = rng.randint(10, 40)
        requests.append(
            dict(
                id=f"r{i}",
                prompt_token_ids=(system if i % 2 else [])
                + [rng.randrange(1, 8000) for _ in range(30)],
                output_token_ids=list(range(7, 7 + out)),
                max_tokens=out,
                arrival_step=i * 2,
            )
        )
    return workload(requests, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def run_server(
    directory: Path, w: SimWorkload, snapshot_interval: int = 16, **options: Any
) -> tuple[ServerRecording, EngineCore]:
    """Run `w` to the end under a ServerRecording, left open, one fake second a step."""
    engine = make_engine(w)
    clock = FakeClock()
    rec = ServerRecording(
        engine, directory, snapshot_interval=snapshot_interval, clock=clock, **options
    )
    for _ in run_steps(w, engine):
        clock.now += STEP_NS
    return rec, engine


def record_server(
    directory: Path, w: SimWorkload, **options: Any
) -> tuple[ServerRecording, EngineCore]:
    """run_server's recording, closed."""
    rec, engine = run_server(directory, w, **options)
    rec.close()
    return rec, engine


def record_file(path: Path, w: SimWorkload) -> None:
    engine = make_engine(w)
    Recorder(engine, TraceWriter(path), RecorderOptions(snapshot_interval=16, strict=True))
    for _ in run_steps(w, engine):
        pass
    engine.close()


def states(reader: TraceReader) -> list[object]:
    tl = Timeline(reader)
    return [tl.state(s).to_snapshot() for s in range(tl.first_step, tl.last_step + 1)]


def first_step(path: Path) -> int:
    with TraceReader(path) as r:
        return r.header.first_step


def sizes(directory: Path) -> list[int]:
    return [s.path.stat().st_size for s in list_segments(directory)]


# -- rotation --------------------------------------------------------------------------------


def test_rotation_keeps_the_bound_and_each_kept_segment_replays_alone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    bound = MIN_MAX_BYTES
    rec, engine = record_server(run, busy_workload(ROTATING), max_bytes=bound)
    segs = list_segments(run)
    assert segs[0].seq > 0, "the oldest segments were deleted"
    assert sum(sizes(run)) <= bound
    assert [s.seq for s in segs] == list(range(segs[0].seq, segs[0].seq + len(segs)))
    whole = tmp_path / "whole.trace"
    record_file(whole, busy_workload(ROTATING))
    with TraceReader(whole) as r:
        reference = states(r)
    last: int | None = None
    for seg in segs:
        with TraceReader(seg.path) as r:
            assert r.closed_cleanly
            if last is not None:
                assert r.header.first_step == last + 1, "segments continue each other"
            got = states(r)
            first = r.header.first_step
            assert got == reference[first : first + len(got)], seg.path.name
            last = r.index().last_step
        # the reading commands take it on its own
        stats = trace_stats(seg.path)
        assert stats.num_steps == last - first + 1
        out = CliRunner().invoke(main, ["find", str(seg.path), "free<64", "--all"])
        assert out.exit_code in (0, 1), out.output
    assert last == engine.step_index - 1


def test_the_directory_is_one_trace(tmp_path: Path) -> None:
    w = busy_workload()
    # A large bound (nothing is deleted) with small segments.
    run2 = tmp_path / "run2"
    engine2 = make_engine(w)
    rec2 = ServerRecording(engine2, run2, max_bytes=64 << 20, snapshot_interval=16)
    rec2.segment_bytes = 4096
    for _ in run_steps(w, engine2):
        pass
    rec2.close()
    segs = list_segments(run2)
    assert len(segs) >= 5 and segs[0].seq == 0
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with TraceReader(whole) as a, open_trace(run2) as b:
        assert isinstance(b, SegmentedReader)
        assert b.closed_cleanly and b.header.first_step == 0
        assert states(b) == states(a)
        # state_at() seeks through the combined index, from the nearest snapshot
        last = b.index().last_step
        for step in range(0, last + 1, 5):
            assert state_at(b, step).to_snapshot() == state_at(a, step).to_snapshot()
    # resim of the directory reproduces every decision
    result = resimulate(run2)
    assert result.reproduced and result.num_recorded_steps == last + 1
    # the commands take the directory
    runner = CliRunner()
    info = runner.invoke(main, ["info", str(run2)])
    assert info.exit_code == 0, info.output
    assert f"segments  {len(segs)}: segment-000000.trace .. " in info.output
    assert f"steps     {last + 1:,} (0..{last})" in info.output
    assert "closed    yes" in info.output
    assert runner.invoke(main, ["resim", str(run2)]).exit_code == 0
    assert runner.invoke(main, ["diff", str(run2), str(whole)]).exit_code == 0
    stats = runner.invoke(main, ["stats", str(run2), "--json"])
    assert json.loads(stats.output)["num_steps"] == last + 1
    out = tmp_path / "p.json"
    assert runner.invoke(main, ["export", str(run2), "--perfetto", str(out)]).exit_code == 0
    assert json.loads(out.read_text())["traceEvents"]


def test_replay_crosses_segment_boundaries_step_by_step(tmp_path: Path) -> None:
    w = busy_workload(24)
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run", snapshot_interval=1000)
    rec.segment_bytes = 3000
    for _ in run_steps(w, engine):
        pass
    rec.close()
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with open_trace(tmp_path / "run") as r, TraceReader(whole) as ref:
        assert isinstance(r, SegmentedReader) and len(r.segments) >= 3
        boundaries = [first_step(p) for p in r.segments[1:]]
        tl, ref_tl = Timeline(r), Timeline(ref)
        for b in boundaries:  # forwards over the boundary, then back
            for s in (b - 2, b - 1, b, b + 1, b, b - 1, b - 2):
                if s > tl.last_step:
                    continue
                assert tl.state(s).to_snapshot() == ref_tl.state(s).to_snapshot(), s
                assert differing_fields(tl.record(s), ref_tl.record(s)) == ()


def test_a_missing_middle_segment_is_a_clear_error(tmp_path: Path) -> None:
    w = busy_workload(24)
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run")
    rec.segment_bytes = 3000
    for _ in run_steps(w, engine):
        pass
    rec.close()
    segs = list_segments(tmp_path / "run")
    segs[1].path.unlink()
    with pytest.raises(TraceError, match="segment 1 is missing"):
        open_trace(tmp_path / "run")
    with (
        TraceReader(segs[0].path) as a,
        TraceReader(segs[2].path) as b,
        pytest.raises(TraceError, match="a segment is missing"),
    ):
        join([a, b], tmp_path / "joined.trace")
    assert not (tmp_path / "joined.trace").exists()
    assert not (tmp_path / "joined.trace.part").exists()


def test_the_first_segments_deleted_leave_a_mid_run_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    record_server(run, busy_workload(ROTATING), max_bytes=MIN_MAX_BYTES)
    first = list_segments(run)[0]
    assert first.seq > 0
    with open_trace(run) as r:
        assert r.header.first_step > 0
        states(r)  # every step from the first kept segment's snapshot on
    with pytest.raises(ResimError, match="starts mid-run"):
        resimulate(run)


def test_a_too_small_bound_is_refused(tmp_path: Path) -> None:
    engine = make_engine(busy_workload(2))
    with pytest.raises(ValueError, match="max_bytes=1000: must be at least"):
        ServerRecording(engine, tmp_path / "run", max_bytes=1000)


def test_open_server_recording_makes_one_directory_per_run(tmp_path: Path) -> None:
    from engine.events import NULL_SINK

    engine = make_engine(busy_workload(2))
    a = open_server_recording(engine, tmp_path)
    assert engine.sink is a
    a.close()
    assert engine.sink is NULL_SINK
    b = open_server_recording(make_engine(busy_workload(2)), tmp_path)
    b.close()
    assert a.directory.parent == tmp_path and a.directory != b.directory
    assert "-serve-" in a.directory.name
    assert list_segments(a.directory)


# -- incidents ------------------------------------------------------------------------------


def incident_while_idle(rec: ServerRecording, window_s: float, note: str | None) -> Path:
    """incident() from a server thread while the engine thread idles: the engine thread
    flushes what it had buffered when on_idle() sees the request."""
    stop = threading.Event()

    def engine_thread() -> None:
        while not stop.is_set():
            rec.on_idle()
            stop.wait(0.01)

    t = threading.Thread(target=engine_thread)
    t.start()
    try:
        return rec.incident(window_s, note).path
    finally:
        stop.set()
        t.join()


def test_incident_copies_the_segments_covering_the_window(tmp_path: Path) -> None:
    w = busy_workload()
    rec, engine = run_server(tmp_path / "run", w, segment_s=10.0)
    last = engine.step_index - 1
    path = incident_while_idle(rec, 25.0, "p99 went up")
    rec.close()
    # segments of 10 steps (10 s): the window of 25 s reaches back into the segment
    # that ends 20..30 s ago, so the incident starts at that segment's first step
    info = summarize(path)
    assert info.closed_cleanly and info.last_step == last
    assert last - 35 < info.first_step <= last - 24
    with TraceReader(path) as r:
        assert r.header.first_step == info.first_step
        ref = tmp_path / "whole.trace"
        record_file(ref, w)
        with TraceReader(ref) as whole:
            got, want = states(r), states(whole)
            assert got == want[info.first_step :]
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["note"] == "p99 went up" and meta["window_s"] == 25.0
    assert meta["first_step"] == info.first_step and meta["last_step"] == last
    out = CliRunner().invoke(main, ["info", str(path)])
    assert out.exit_code == 0 and "closed    yes, cleanly" in out.output
    # the incident is not a segment: the directory still reads as before
    with open_trace(tmp_path / "run") as r:
        assert r.index().last_step == last


def test_an_incident_is_cut_at_a_step_boundary_inside_a_segment(tmp_path: Path) -> None:
    """Segments of 1000 s, a snapshot every 8 steps: a 25 s window starts at the last
    snapshot before it, not at the segment's first step (issue 26: `window_s: 30` gave
    78 s of steps)."""
    w = busy_workload()
    rec, engine = run_server(tmp_path / "run", w, snapshot_interval=8, segment_s=1000.0)
    last = engine.step_index - 1
    assert len(list_segments(tmp_path / "run")) == 1 and last > 60
    path = incident_while_idle(rec, 25.0, None)
    rec.close()
    info = summarize(path)
    assert info.closed_cleanly and info.last_step == last
    assert last - 25 - 8 <= info.first_step <= last - 24
    with TraceReader(path) as r, TraceReader(list_segments(tmp_path / "run")[0].path) as whole:
        assert r.header.first_step == info.first_step
        got, want = states(r), states(whole)
        assert got == want[info.first_step :]
    meta = json.loads(path.with_suffix(".json").read_text())
    assert (meta["first_step"], meta["last_step"]) == (info.first_step, last)


def test_a_last_segment_its_writer_died_creating_ends_the_trace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec, engine = record_server(run, busy_workload(8))
    last = engine.step_index - 1
    (run / "segment-000001.trace").write_bytes(b"\x89STR")  # killed while writing it
    info = summarize(run)
    assert info.last_step == last and not info.closed_cleanly
    assert info.cut is not None and "segment-000001.trace" in info.cut.reason
    out = CliRunner().invoke(main, ["info", str(run)])
    assert out.exit_code == 0 and "cut" in out.output


# -- following a live run ---------------------------------------------------------------------


def test_a_live_timeline_follows_rotation_and_deletion(tmp_path: Path) -> None:
    w = busy_workload(ROTATING)
    engine = make_engine(w)
    run = tmp_path / "run"
    rec = ServerRecording(engine, run, max_bytes=MIN_MAX_BYTES, snapshot_interval=16)
    steps = run_steps(w, engine)
    for _ in range(5):
        next(steps)
    rec.on_idle()  # flushes
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with open_trace(run) as r, TraceReader(whole) as ref:
        tl = Timeline(r, live=True)
        assert tl.last_step == 4 and not tl.finished
        seen_deleted = False
        for i, _ in enumerate(steps):
            if i % 9 == 0:
                rec.on_idle()
                tl.refresh()
                s = tl.last_step
                assert tl.state(s).to_snapshot() == state_at(ref, s).to_snapshot()
                seen_deleted = seen_deleted or not (run / "segment-000000.trace").exists()
        rec.close()
        tl.refresh()
        assert tl.finished and tl.last_step == engine.step_index - 1
        assert seen_deleted, "old segments went while it followed"
        # the deleted segments are still open here: going back to step 0 works
        assert tl.state(0).to_snapshot() == state_at(ref, 0).to_snapshot()


def test_schedtop_attaches_to_a_run_directory_being_written(tmp_path: Path) -> None:
    from tui.launch import choose

    older = tmp_path / "20200101-000000.000-sim-1.trace"
    record_file(older, busy_workload(4))
    engine = make_engine(busy_workload(4))
    rec = open_server_recording(engine, tmp_path)
    rec.on_idle()
    choice = choose(tmp_path)
    assert choice is not None and choice.path == rec.directory and choice.live
    rec.close()
    choice = choose(tmp_path)
    assert choice is not None and choice.path == rec.directory and not choice.live


@app_test
async def test_schedtop_replay_of_a_directory_steps_across_a_boundary(tmp_path: Path) -> None:
    w = busy_workload(16)
    engine = make_engine(w)
    rec = ServerRecording(engine, tmp_path / "run", snapshot_interval=1000)
    rec.segment_bytes = 2500
    for _ in run_steps(w, engine):
        pass
    rec.close()
    second = list_segments(tmp_path / "run")[1].path
    boundary = first_step(second)
    whole = tmp_path / "whole.trace"
    record_file(whole, w)
    with TraceReader(whole) as ref_reader:
        await _step_across(tmp_path / "run", Timeline(ref_reader), boundary)


async def _step_across(run: Path, ref: Timeline, boundary: int) -> None:
    app = make_app(run)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("g")
        await submit(pilot, str(boundary - 2))
        for key, step in [("right", boundary - 1), ("right", boundary), ("right", boundary + 1)]:
            await pilot.press(key)
            await at_step(pilot, step)
        for step in (boundary, boundary - 1, boundary - 2):
            await pilot.press("left")
            await at_step(pilot, step)
            assert app.frame is not None
            want = ref.state(step)
            assert app.frame.header.running == len(want.running)
            assert app.frame.header.free_blocks == len(want.free)


def test_poll_follows_a_directory_to_its_end(tmp_path: Path) -> None:
    w = busy_workload(16)
    engine = make_engine(w)
    run = tmp_path / "run"
    rec = ServerRecording(engine, run, snapshot_interval=16)
    rec.segment_bytes = 2000
    steps = run_steps(w, engine)
    next(steps)
    rec.on_idle()
    seen: list[int] = []
    with open_trace(run) as r:
        for i, _ in enumerate(steps):
            if i % 5 == 0:
                rec.on_idle()
                seen += [e.record.step for e in r.poll() if isinstance(e.record, Step)]
        rec.close()
        seen += [e.record.step for e in r.poll() if isinstance(e.record, Step)]
        assert r.finished
        assert len(list_segments(run)) > 3
    assert seen == list(range(engine.step_index))


def test_a_directory_with_another_runs_segments_is_refused(tmp_path: Path) -> None:
    from recorder.errors import RecordingError

    record_server(tmp_path / "run", busy_workload(2))
    before = sizes(tmp_path / "run")
    with pytest.raises(RecordingError, match="holds another run's segments"):
        ServerRecording(make_engine(busy_workload(2)), tmp_path / "run")
    assert sizes(tmp_path / "run") == before
