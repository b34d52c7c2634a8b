"""Recording: the trace holds every decision, and the state the reducer rebuilds from it
equals the engine's own state after every step."""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore, StepResult
from engine.events import EventSink
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.records import (
    HASH_BYTES,
    Admission,
    Kernel,
    Kind,
    KVEvents,
    KVKind,
    Scheduled,
    Timing,
    ns,
)
from engine.request import Request, SamplingParams
from engine.sim.api import demo_workload_path
from engine.sim.runner import SimRunner
from engine.sim.workload import load_workload
from recorder.errors import TraceError
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions, open_recording
from recorder.schema import Snapshot, Step
from recorder.writer import MemoryWriter, TraceWriter
from replays.reducer import StepView, apply, apply_with_view, reduce, replay, state_at
from replays.state import State
from tests.helpers import Recorded, record, req, workload, write_trace

FIDELITY = Path(__file__).parent / "data" / "fidelity"
CASES = [demo_workload_path(), *sorted(FIDELITY.glob("*.workload.json"))]


def replay_all(path: Path) -> tuple[list[State], list[StepView]]:
    """Every step's state (copies) and view, rebuilt from the trace alone; snapshots
    along the way must equal the state the steps built."""
    states: list[State] = []
    views: list[StepView] = []
    with TraceReader(path) as reader:
        state: State | None = None
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Snapshot):
                if state is None:
                    state = State.from_snapshot(reader.header, rec)
                else:
                    assert state.to_snapshot() == rec, f"snapshot after step {rec.step}"
            elif isinstance(rec, Step):
                state = state or State.initial(reader.header)
                views.append(apply_with_view(state, rec, entry.offset))
                state.check_invariants()
                states.append(state.copy())
    return states, views


def same_picture(state: State, engine_state: Snapshot) -> bool:
    return state.to_snapshot() == engine_state


def kv_facts(
    events: KVEvents, names: dict[int, str], before: Snapshot | None
) -> list[tuple[Any, ...]]:
    """The engine's KV events with request ids, EVICTED ones with the hashes they dropped
    (from the engine's block map before the step, and the step's own CACHED events)."""
    cached = {} if before is None else dict(zip(before.cached_block_ids, before.cached_hashes))
    out = []
    for kind, ref, blocks, hashes, tokens in events.rows():
        if kind == KVKind.EVICTED:
            hashes = tuple(cached.pop(b) for b in blocks)
        elif kind == KVKind.CACHED:
            cached.update(zip(blocks, hashes))
        out.append((kind, None if ref is None else names[ref], blocks, hashes, tokens))
    return out


def facts(
    rec: Step,
    scheduled: Sequence[Scheduled],
    sampled: dict[str, list[int]],
    kv: list[tuple[Any, ...]],
    names: dict[int, str],
) -> dict[str, Any]:
    """A step's decisions as plain data, with request ids; the engine's record and the
    trace's (spelled out by the reducer) are the same type, so one function reads both."""
    return dict(
        scheduled=[
            (names[s.ref], s.num_tokens, s.kind, s.num_computed_before, s.num_spec_tokens)
            for s in scheduled
        ],
        sampled=sampled,
        kv=kv,
        admissions=[(names[a.ref], a.cached_tokens, a.resumed) for a in rec.admissions],
        preemptions=[
            (names[p.victim], names[p.for_request], p.tokens_lost, p.unscheduled_tokens)
            for p in rec.preemptions
        ],
        shortfalls=[(names[s.ref], s.wanted, s.got, s.reason) for s in rec.shortfalls],
        stops=[
            None if q is None else (q.head, q.rest) for q in (rec.running_stop, rec.waiting_stop)
        ],
        finishes=[(names[f.ref], f.status, f.message) for f in rec.finishes],
        spec={names[a.ref]: a.accepted for a in rec.spec_accepted},
        arrivals=[
            (
                a.request_id,
                list(a.prompt_token_ids or ()),
                a.priority,
                a.arrival_time,
                a.eos_token_id,
                a.sampling.max_tokens,
            )
            for a in rec.arrivals
        ],
        counts=(rec.token_budget, rec.free_blocks_after_schedule, rec.free_blocks),
    )


def report_facts(result: StepResult, before: Snapshot | None) -> dict[str, Any]:
    """The engine's report of a step."""
    rep, names = result.report, result.names
    kv = kv_facts(rep.kv_events, names, before)
    return facts(rep, rep.scheduled, result.sampled(), kv, names)


def view_facts(view: StepView) -> dict[str, Any]:
    """The trace's record of a step, spelled out by the reducer."""
    rec, names = view.record, dict(view.names)
    names.update((a.ref, a.request_id) for a in rec.arrivals)
    sampled = {names[s.ref]: list(s.token_ids or ()) for s in view.samples}
    kv = [
        (e.kind, None if e.ref is None else names[e.ref], e.block_ids, e.hashes, e.num_tokens)
        for e in view.kv_events
    ]
    return facts(rec, view.scheduled, sampled, kv, names)


def check_recording(run: Recorded, tmp_path: Path) -> list[State]:
    states, views = replay_all(write_trace(tmp_path, run.data))
    assert len(states) == len(run.states)
    for i, (state, engine_state, view, result) in enumerate(
        zip(states, run.states, views, run.results)
    ):
        step = result.report.step
        assert same_picture(state, engine_state), f"step {step}"
        before = run.states[i - 1] if i else None
        assert view_facts(view) == report_facts(result, before), f"step {step}"
    return states


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name.removesuffix(".workload.json"))
def test_rebuilt_state_equals_the_engine_after_every_step(case: Path, tmp_path: Path) -> None:
    check_recording(record(load_workload(case), snapshot_interval=5), tmp_path)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_spec_decode_and_priorities_replay_exactly(policy: str, tmp_path: Path) -> None:
    requests = [
        req(
            f"r{i}",
            20 + 7 * i,
            30 + i,
            arrival_step=i // 3,
            priority=(i * 5) % 3,
            base=1 + 100 * (i % 4),
        )
        for i in range(12)
    ]
    w = workload(
        requests,
        num_blocks=30,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        num_speculative_tokens=2,
        policy=policy,
        long_prefill_token_threshold=24,
        scheduler_reserve_full_isl=False,
    )
    run = record(w, snapshot_interval=4)
    assert any(r.preemptions for r in run.reports)
    assert any(r.spec_accepted for r in run.reports)
    assert any(a.cached_tokens for r in run.reports for a in r.admissions)
    check_recording(run, tmp_path)


class ScriptedEngine:
    """An engine driven by hand: requests added and aborted between steps."""

    def __init__(self, sink: Any = None, **cfg: Any) -> None:
        config = EngineConfig().replace(
            **{"num_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4, **cfg}
        )
        self.runner = SimRunner({})
        self.engine = EngineCore(config, self.runner)
        self.recorder = Recorder(
            self.engine, sink or MemoryWriter(), RecorderOptions(strict=True, snapshot_interval=3)
        )
        self.hasher = BlockHasher(config.block_size)
        self.states: list[Snapshot] = []
        self.reports: list[Step] = []
        self.results: list[StepResult] = []

    def add(self, rid: str, n: int, max_tokens: int = 6, **kw: Any) -> None:
        self.runner.add_script(rid, [5, 6, 7, 8, 9, 10, 11, 12])
        self.engine.add_request(
            Request(
                rid,
                list(range(100, 100 + n)),
                SamplingParams(max_tokens=max_tokens, **kw),
                block_hasher=self.hasher,
            )
        )

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            result = self.engine.step()
            self.results.append(result)
            self.reports.append(result.report)
            self.states.append(self.engine.snapshot())

    def finish(self) -> Recorded:
        while self.engine.has_unfinished():
            self.step()
        self.engine.close()
        return Recorded(self.recorder, self.engine, self.states, self.reports, self.results)


def test_aborts_errors_stop_tokens_and_reused_ids(tmp_path: Path) -> None:
    e = ScriptedEngine()
    e.add("a", 40)
    e.add("b", 20, stop_token_ids=(7,))
    e.add("huge", 2000)  # can never fit: finishes with an error at once
    e.step(2)
    e.engine.abort("a")  # running, holding blocks
    e.add("a", 10)  # the same id again, in the same gap between steps
    e.add("c", 30)
    e.step()
    e.engine.abort("c")
    e.add("c", 17)
    e.engine.abort("c")  # a reused id aborted again before it ever ran
    e.add("c", 5)
    run = e.finish()
    statuses = [(r.names[f.ref], int(f.status)) for r in run.results for f in r.report.finishes]
    assert ("huge", 6) in statuses and ("b", 3) in statuses
    assert statuses.count(("a", 5)) == 1 and statuses.count(("c", 5)) == 2
    check_recording(run, tmp_path)


def test_determinism_same_workload_same_trace_after_masking(tmp_path: Path) -> None:
    """Recorded twice, the traces differ only in timing fields and the header clock; the
    masking is done on the records the reader returns, which are then re-encoded."""
    w = load_workload(demo_workload_path())
    paths = []
    for name in ("one.trace", "two.trace"):
        record(w, TraceWriter(tmp_path / name), snapshot_interval=32)
        paths.append(tmp_path / name)
    encoded = [_masked(p) for p in paths]
    assert encoded[0] == encoded[1]
    assert len(encoded[0]) > 150


def _masked(path: Path) -> list[bytes]:
    from recorder.codec import encode
    from recorder.schema import End, Footer

    out = []
    with TraceReader(path) as reader:
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Step):
                rec = dataclasses.replace(
                    rec, time_ns=0, schedule_ns=0, update_ns=0, timings=(), work_ns=0
                )
            elif isinstance(rec, Footer):  # offsets move with the timing fields' sizes
                rec = dataclasses.replace(rec, step_offsets=(), snapshot_offsets=(), end_time_ns=0)
            elif isinstance(rec, End):
                rec = End(0)
            out.append(encode(rec)[1])
        out.insert(0, encode(dataclasses.replace(reader.header, start_time_ns=0))[1])
    return out


def test_redacted_traces_hold_no_token_ids_but_replay_the_prefix_cache(tmp_path: Path) -> None:
    w = load_workload(demo_workload_path())
    run = record(w, redact_prompts=True, snapshot_interval=16)
    with TraceReader(write_trace(tmp_path, run.data)) as reader:
        assert reader.header.redacted
        steps = list(reader.steps())
    arrivals = [a for s in steps for a in s.arrivals]
    assert arrivals and all(a.prompt_token_ids is None for a in arrivals)
    reported = [x.prompt_block_hashes for r in run.reports for x in r.arrivals]
    # The engine's whole SHA-256 hashes, kept as their first HASH_BYTES.
    assert all(len(h) == 32 for b in reported for h in b or ())
    assert all(
        a.prompt_block_hashes == tuple(h[:HASH_BYTES] for h in b)
        for a, b in zip(arrivals, reported, strict=True)
    )
    assert all(s.sampled_tokens is None for s in steps)
    # A prompt token sequence from the workload appears nowhere in the file.
    tokens = w.requests[0].prompt_token_ids[:6]
    assert token_bytes(tokens) not in run.data
    assert token_bytes(tokens) in record(w).data  # where an unredacted trace has them
    states, views = replay_all(write_trace(tmp_path, run.data, "r.trace"))
    assert any(a.cached_tokens for r in run.reports for a in r.admissions)
    for state, engine_state in zip(states, run.states):
        assert same_picture(state, engine_state)
    counts = [sum(s.count for s in v.samples) for v in views]
    assert counts == [sum(map(len, r.sampled().values())) for r in run.results]


def token_bytes(tokens: list[int]) -> bytes:
    """How token ids look in an unredacted trace: a packed little-endian array."""
    from recorder.codec import pack_ints

    return pack_ints(tokens)[1:]


@pytest.mark.parametrize("background", [False, True])
def test_disk_full_stops_recording_and_the_engine_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, background: bool
) -> None:
    budget = [6000]

    def write(fd: int, data: memoryview) -> int:
        import os

        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = min(len(data), budget[0])
        budget[0] -= n
        return os.write(fd, data[:n])

    path = tmp_path / "full.trace"
    w = load_workload(demo_workload_path())
    with caplog.at_level(logging.WARNING, logger="schedtop.recorder"):
        run = record(w, TraceWriter(path, write=write), background=background)
    assert len(run.states) > 100  # the engine ran to the end
    assert run.recorder.error and "No space left on device" in run.recorder.error
    assert "recording stopped" in caplog.text and caplog.text.count("recording stopped") == 1
    if background:  # the encoding thread is gone too
        assert not run.recorder.background_thread.is_alive()
    with TraceReader(path) as reader:
        steps = list(reader.steps())
        assert not reader.closed_cleanly
        assert reader.cut is not None and reader.cut.offset < 6000
    assert steps and [s.step for s in steps] == list(range(len(steps)))


def test_attached_mid_run_the_trace_starts_with_a_snapshot(tmp_path: Path) -> None:
    e = ScriptedEngine()
    e.add("a", 40)
    e.add("b", 20)
    e.step(2)
    sink = MemoryWriter()
    e.recorder.close()
    Recorder(e.engine, sink, RecorderOptions(strict=True, snapshot_interval=100))
    e.add("c", 30)
    e.step()
    e.engine.abort("b")
    e.states.clear()
    e.reports.clear()
    e.results.clear()
    run = e.finish()
    path = write_trace(tmp_path, sink.data)
    with TraceReader(path) as reader:
        assert reader.header.first_step == 2
        first = next(reader.entries()).record
        assert isinstance(first, Snapshot) and first.step == 1
        assert len(reader.index().step_offsets) == len(run.states) + 1
        for step in range(3, 3 + len(run.states)):
            assert same_picture(state_at(reader, step), run.states[step - 3])


def test_attaching_after_unreported_changes_is_refused() -> None:
    e = ScriptedEngine()
    e.add("a", 10)
    e.step()
    e.add("b", 10)
    with pytest.raises(ValueError, match="right after a step"):
        Recorder(e.engine, MemoryWriter())


class TimedRunner(SimRunner):
    """Reports timings one step late, as a CUDA runner does, with a kernel breakdown."""

    def __init__(self) -> None:
        super().__init__({})
        self.pending: Timing | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(out)
        late, self.pending = (
            self.pending,
            Timing(
                out.step,
                ns(0.001),
                ns(0.02 + out.step * 1e-6),
                None if out.step % 2 else ns(0.005),
                ns(0.0003),
                (Kernel("attention", 12, ns(0.004)), Kernel("matmul", 40, ns(0.012))),
            ),
        )
        result.timings = [late] if late is not None else []
        return result


def test_timings_are_recorded_and_read_back(tmp_path: Path) -> None:
    runner = TimedRunner()
    engine = EngineCore(EngineConfig(num_blocks=64), runner)
    recorder = Recorder(engine, MemoryWriter(), RecorderOptions(strict=True))
    runner.add_script("a", list(range(20)))
    engine.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=10)))
    sent = []
    while engine.has_unfinished():
        rep = engine.step().report
        sent.append((rep.schedule_ns, rep.update_ns, list(rep.timings)))
    engine.close()
    with TraceReader(write_trace(tmp_path, recorder.sink.data)) as reader:
        steps = list(reader.steps())
    assert [s.schedule_ns for s in steps] == [x[0] for x in sent]
    assert all(s.update_ns > 0 and s.time_ns > 0 for s in steps)
    for step, (_, _, timings) in zip(steps, sent):
        assert [t.step for t in step.timings] == [t.step for t in timings]
        for got, want in zip(step.timings, timings):
            assert got.forward_ns == want.forward_ns
            assert got.attention_ns == want.attention_ns
            assert [(k.name, k.calls, k.total_ns) for k in got.kernels] == [
                (k.name, k.calls, k.total_ns) for k in want.kernels
            ]
    assert steps[1].timings[0].step == 0  # measured in step 0, arrived with step 1


def test_a_step_s_time_is_the_engine_s_end_of_work_on_the_arrivals_clock(
    tmp_path: Path,
) -> None:
    """Where the engine stamps arrivals (LLMEngine), a step's time_ns is its clock's
    reading when the step's work ended (EngineCore.last_end), on the arrivals' origin:
    not the recorder's own clock when its on_step ran, which a thread kept from the
    interpreter reads late. A server's /metrics fold the same reading, so they agree."""
    engine_now = [100.0]
    late = [0]

    def engine_clock() -> float:
        engine_now[0] += 0.001  # every read a millisecond on
        return engine_now[0]

    def recorder_clock() -> int:  # the recorder's thread gets the interpreter 7 ms late
        late[0] += 7_000_000
        return late[0]

    runner = SimRunner({"a": list(range(6))})
    engine = EngineCore(EngineConfig(num_blocks=64), runner, clock=engine_clock)
    engine.arrival_clock = engine_clock
    recorder = Recorder(engine, MemoryWriter(), RecorderOptions(strict=True, clock=recorder_clock))
    origin = recorder.header.arrival_origin_ns
    assert origin is not None
    engine.add_request(Request("a", list(range(40)), SamplingParams(max_tokens=4)))
    ends = []
    while engine.has_unfinished():
        engine.step()
        ends.append(round(engine.last_end * 1e9) - origin)
    engine.close()
    with TraceReader(write_trace(tmp_path, recorder.sink.data)) as reader:
        assert [s.time_ns for s in reader.steps()] == ends
    # An engine with no arrival clock (the simulation): the recorder's own clock.
    sim = EngineCore(EngineConfig(num_blocks=64), SimRunner({}))
    assert (
        Recorder(sim, MemoryWriter(), RecorderOptions(clock=recorder_clock))._timed_engine is None
    )


class Collecting(EventSink):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def on_step(self, report: Step) -> None:
        self.steps.append(report.step)

    def close(self) -> None:
        self.closed = True


def test_the_recorder_passes_reports_on_to_the_sink_it_replaced() -> None:
    w = load_workload(FIDELITY / "a_decode_plus_arrival.workload.json")
    from engine.sim.driver import make_engine, run_steps

    downstream = Collecting()
    engine = make_engine(w, downstream)
    recorder = Recorder(engine, MemoryWriter())
    n = len(list(run_steps(w, engine)))
    engine.close()
    assert downstream.steps == list(range(n)) and downstream.closed
    assert engine.sink is downstream and recorder.error is None


def test_a_recorder_bug_stops_recording_not_the_engine(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    w = load_workload(demo_workload_path())
    from engine.sim.driver import make_engine, run_steps

    engine = make_engine(w)
    recorder = Recorder(engine, MemoryWriter())
    compactor = recorder._compactor
    real = compactor.compact

    def flaky(rep: Step, *args: Any) -> Step:
        if rep.step == 30:
            raise RuntimeError("boom")
        return real(rep, *args)

    compactor.compact = flaky  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="schedtop.recorder"):
        n = len(list(run_steps(w, engine)))
    engine.close()
    assert n > 100 and recorder.error == "step 30: RuntimeError: boom"
    with TraceReader(write_trace(tmp_path, recorder.sink.data)) as reader:
        assert [s.step for s in reader.steps()] == list(range(30))
        assert not reader.closed_cleanly


def test_footer_totals_and_flushed_step(tmp_path: Path) -> None:
    w = load_workload(demo_workload_path())
    path = tmp_path / "t.trace"
    writer = TraceWriter(path, live=False, flush_bytes=1 << 30, flush_interval_s=1e9)
    run = record(w, writer, snapshot_interval=50)
    assert run.recorder.flushed_step == len(run.states) - 1
    with TraceReader(path) as reader:
        footer = reader.footer
        assert footer is not None
        assert footer.num_steps == len(run.states)
        assert footer.num_arrivals == len(w.requests)
        assert footer.num_finishes == len(w.requests)
        assert footer.num_preemptions == sum(len(r.preemptions) for r in run.reports)
        assert footer.snapshot_steps == (49, 99, 149)


def test_flushed_step_lags_in_batch_mode_and_catches_up_in_live_mode(tmp_path: Path) -> None:
    e = ScriptedEngine(
        TraceWriter(tmp_path / "batch.trace", live=False, flush_bytes=1 << 30, flush_interval_s=1e9)
    )
    e.add("a", 40)
    e.step(4)
    assert e.recorder.flushed_step == -1  # everything is still in the buffer
    e.recorder.sink.drain()
    assert e.recorder.flushed_step == 3
    live = ScriptedEngine(TraceWriter(tmp_path / "live.trace"))
    live.add("a", 40)
    live.step(4)
    live.recorder.sink.drain()
    assert live.recorder.flushed_step == 3
    e.finish()
    live.finish()


def test_open_recording_writes_into_the_trace_directory(trace_dir: Path) -> None:
    from engine.sim.driver import make_engine, run_steps

    w = load_workload(FIDELITY / "a_decode_plus_arrival.workload.json")
    engine = make_engine(w)
    recorder = open_recording(engine, kind="sim")
    list(run_steps(w, engine))
    engine.close()
    assert recorder.path is not None and recorder.path.parent == trace_dir
    assert "-sim-" in recorder.path.name
    with TraceReader(recorder.path) as reader:
        assert reader.closed_cleanly


def test_a_live_recording_reaches_the_file_on_its_timer_without_more_steps(
    tmp_path: Path,
) -> None:
    """open_recording's live trace is written about every LIVE_WRITE_S as the engine
    steps, not at every step's end; the steps after the last such write reach the file
    on the recorder's flush timer (within LIVE_FLUSH_S), with no further step and no
    close."""
    from engine.sim.driver import make_engine, run_steps
    from recorder.recorder import LIVE_FLUSH_S, LIVE_WRITE_S

    w = load_workload(demo_workload_path())
    engine = make_engine(w)
    path = tmp_path / "live.trace"
    recorder = open_recording(engine, path)
    assert recorder.options.flush_interval_s == LIVE_FLUSH_S
    assert not recorder.sink.live and recorder.sink.flush_interval_s == LIVE_WRITE_S
    steps = run_steps(w, engine)
    for _ in range(30):
        last = next(steps).report.step
    deadline = time.monotonic() + 30  # far beyond the bound: only a missing flush waits
    seen = -1
    while seen < last and time.monotonic() < deadline:
        try:
            with TraceReader(path) as reader:
                seen = max((s.step for s in reader.steps()), default=-1)
        except TraceError as e:  # not even the preamble written yet
            assert e.incomplete
        if seen < last:
            time.sleep(0.01)
    assert seen == last
    engine.close()


def test_reducer_copies_are_independent_and_reduce_is_pure(tmp_path: Path) -> None:
    run = record(load_workload(demo_workload_path()))
    with TraceReader(write_trace(tmp_path, run.data)) as reader:
        steps = list(reader.steps())
        state = State.initial(reader.header)
    for s in steps[:60]:
        apply(state, s)
    before = state.copy()
    for s in steps[60:90]:
        apply(state, s)
    assert same_picture(before, run.states[59]) and same_picture(state, run.states[89])
    after = reduce(before, steps[60])
    assert same_picture(before, run.states[59]) and same_picture(after, run.states[60])
    owners = after.block_owners()
    assert [len(o) for o in owners] == list(after.ref_cnts)
    assert all(after.request_id(ref) for o in owners for ref in o)
    budgets = [s.num_scheduled_tokens for s in steps]
    assert budgets == [r.num_scheduled_tokens for r in run.reports]


def test_replay_yields_every_state_and_checks_snapshots(tmp_path: Path) -> None:
    run = record(load_workload(demo_workload_path()), snapshot_interval=10)
    with TraceReader(write_trace(tmp_path, run.data)) as reader:
        pictures = [s.to_snapshot() for s in replay(reader.header, reader.entries())]
    assert pictures == run.states


@pytest.mark.parametrize("redact", [False, True])
def test_steady_decode_shortcut_makes_the_same_record(redact: bool) -> None:
    from engine.sim.driver import make_engine, run_steps
    from recorder.codec import encode
    from recorder.convert import StepCompactor

    w = load_workload(demo_workload_path())
    fast, slow = StepCompactor(w.config.policy, redact), StepCompactor(w.config.policy, redact)
    taken = 0
    for result in run_steps(w, make_engine(w)):
        rep = result.report
        steady = fast._steady(rep, rep.step)
        if steady is None:
            fast.general(rep, rep.step)
        step = slow.general(rep, rep.step)
        if steady is not None:
            taken += 1
            assert steady == step and encode(steady) == encode(step), rep.step
    assert taken > 20  # the demo has long runs of pure decoding


@pytest.mark.parametrize("redact", [False, True])
def test_a_step_reported_compact_is_written_as_the_compactor_would(redact: bool) -> None:
    """recorder.vllm reports steady decode steps already compact (num_decodes, no entries):
    the trace gets the record the compactor's own shortcut makes of the explicit step."""
    from engine.sim.driver import make_engine, run_steps
    from recorder.codec import encode
    from recorder.convert import StepCompactor

    w = load_workload(demo_workload_path())
    ours, theirs = StepCompactor(w.config.policy, redact), StepCompactor(w.config.policy, redact)
    taken = 0
    for result in run_steps(w, make_engine(w)):
        rep = result.report
        expected = theirs.compact(rep, rep.step)
        if ours._steady(rep, rep.step) is None:
            assert ours.compact(rep, rep.step) == expected
            continue
        compact = dataclasses.replace(
            rep, scheduled=(), num_decodes=len(rep.scheduled), running=None, waiting=None
        )
        got = ours.compact(compact, rep.step)
        assert got == expected and encode(got) == encode(expected), rep.step
        taken += 1
    assert taken > 20


def test_a_compact_step_that_is_not_the_running_queue_is_refused() -> None:
    from recorder.convert import StepCompactor

    compactor = StepCompactor("fcfs", False)
    compactor.running = (0, 1, 2)
    with pytest.raises(ValueError, match="num_decodes=2 must be a steady decode of all 3"):
        compactor.compact(Step(step=5, num_decodes=2, sampled_tokens=(7, 8)))
    with pytest.raises(ValueError, match="must give both queues"):
        compactor.compact(Step(step=5, num_decodes=3, sampled_tokens=(7, 8, 9), running=(0,)))
    with pytest.raises(ValueError, match="at most as many decodes"):
        compactor.compact(Step(step=5, num_decodes=4, running=(0, 1, 2), waiting=()))


def test_a_reporter_s_implicit_decodes_stay_implicit_beside_an_admission() -> None:
    """recorder.vllm reports a step with an admission with its leading decodes implicit
    already: the compactor keeps them so, and still leaves out queues it can derive."""
    from recorder.convert import StepCompactor

    compactor = StepCompactor("fcfs", False)
    compactor.running, compactor.waiting = (0, 1, 2), (3, 4)
    admitted = Scheduled(3, 8, Kind.PREFILL, 0)
    rep = Step(
        step=5,
        num_decodes=3,
        scheduled=(admitted,),
        admissions=(Admission(3, 0, False),),
        sampled_tokens=(7, 8, 9, 10),
        running=(0, 1, 2, 3),
        waiting=(4,),
    )
    step = compactor.compact(rep, 99)
    assert (step.num_decodes, step.scheduled, step.time_ns) == (3, (admitted,), 99)
    assert step.running is None and step.waiting is None  # derived by readers
    assert (compactor.running, compactor.waiting) == ((0, 1, 2, 3), (4,))
    odd = dataclasses.replace(rep, step=6, running=(1, 0, 2, 3), waiting=(4,))
    compactor.running, compactor.waiting = (0, 1, 2), (3, 4)
    assert compactor.compact(odd).running == (1, 0, 2, 3)  # not derivable: kept


def test_a_recording_that_takes_the_steady_path_writes_the_general_paths_trace(
    tmp_path: Path,
) -> None:
    """Recorder._record's steady path (encode_steady from the report's fields) and the
    compactor's general record of the same steps make the same trace but for timings."""
    from engine.sim.driver import make_engine, run_steps
    from tests.test_background_recording import masked

    w = load_workload(demo_workload_path())
    paths = []
    # Steady steps encoded at once, in batches (an hour's batch_s: they wait for a
    # snapshot, another record, MAX_BATCH or the close), and the general path.
    batched = RecorderOptions(strict=True, batch_s=3600.0, flush_interval_s=3600.0)
    for kind, options in (
        ("steady", RecorderOptions(strict=True)),
        ("batched", batched),
        ("general", RecorderOptions(strict=True)),
    ):
        engine = make_engine(w)
        path = tmp_path / f"{kind}.trace"
        recorder = Recorder(engine, TraceWriter(path, live=False), options)
        if kind == "general":
            recorder._compactor.is_steady = lambda rep: False  # type: ignore[method-assign]
        for _ in run_steps(w, engine):
            pass
        engine.close()
        paths.append(path)
    assert masked(paths[0]) == masked(paths[1]) == masked(paths[2])


def test_batched_steady_steps_reach_the_file_on_the_timer_once_the_engine_stops(
    tmp_path: Path,
) -> None:
    """With batch_s, steady steps wait to be encoded together; when the engine stops
    stepping, the flush timer encodes and writes them (here long before the batch's
    hour), with no further step and no close."""
    from engine.sim.driver import make_engine, run_steps
    from tests.test_background_recording import wait_until

    w = load_workload(demo_workload_path())
    engine = make_engine(w)
    path = tmp_path / "t.trace"
    options = RecorderOptions(batch_s=3600.0, flush_interval_s=0.02)
    recorder = Recorder(engine, TraceWriter(path, live=False, flush_interval_s=3600.0), options)
    steps = run_steps(w, engine)
    last = -1
    while not recorder._pending:  # up to a steady step left waiting
        last = next(steps).report.step
    wait_until(lambda: recorder.flushed_step == last, "the timer's write")
    with TraceReader(path) as reader:
        assert [s.step for s in reader.steps()] == list(range(last + 1))
    engine.close()


def test_batching_needs_the_flush_timer_and_not_the_background() -> None:
    """Steps waiting in a batch must reach the file when the engine stops: only the
    flush timer's thread does that; the background thread batches its own way."""
    with pytest.raises(ValueError, match="batch_s needs the flush timer"):
        RecorderOptions(batch_s=0.01)
    with pytest.raises(ValueError, match="batch_s needs the flush timer"):
        RecorderOptions(batch_s=0.01, flush_interval_s=1.0, background=True)
    with pytest.raises(ValueError, match="batch_s=-1"):
        RecorderOptions(batch_s=-1)


def test_the_flush_timer_wakes_an_interval_after_the_last_write(tmp_path: Path) -> None:
    """Without a background thread the timer asks to wake an interval after the sink's
    last write (a record appended since then waits at most that), never later, and an
    idle sink's timer once an interval, not more often."""
    from engine.sim.driver import make_engine

    now = [100.0]
    writer = TraceWriter(tmp_path / "t.trace", live=False, clock=lambda: now[0])
    engine = make_engine(load_workload(demo_workload_path()))
    recorder = Recorder(engine, writer, RecorderOptions(flush_interval_s=1.0))
    try:
        writer.flush()  # the header: the last write, at 100.0; nothing is buffered after
        # (age of the last write, wait): 5.0 is an idle sink, -1.0 a clock gone back.
        for age, wait in ((0.0, 1.0), (0.3, 0.7), (0.99, 0.125), (5.0, 1.0), (-1.0, 1.0)):
            now[0] = 100.0 + age
            assert recorder._timed_flush() == pytest.approx(wait)
    finally:
        engine.close()
