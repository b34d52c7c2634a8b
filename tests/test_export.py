"""`schedtop export --perfetto`: valid trace-event JSON that shows every request's life,
the steps, the counters and the preemption arrows, checked against the records."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine.sim.api import demo_workload_path
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import load_workload
from recorder.codec import encode
from recorder.framing import frame, preamble
from recorder.reader import TraceReader
from recorder.recorder import Recorder, RecorderOptions
from recorder.schema import Kernel, Kind, Snapshot, Status, Step, Timing
from recorder.writer import MemoryWriter
from replays.export import IDLE_MIN_NS, export_perfetto
from replays.reducer import StepView, apply_with_view
from replays.state import State
from tests.helpers import record, req, workload, write_trace
from tui.cli import main

FIDELITY = Path(__file__).parent / "data" / "fidelity"
Event = dict[str, Any]

# -- the format's rules ---------------------------------------------------------------------

_METADATA = {
    "process_name": "name",
    "thread_name": "name",
    "process_sort_index": "sort_index",
    "thread_sort_index": "sort_index",
}


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _no_lists(v: object) -> bool:
    if isinstance(v, list):
        return False
    return all(_no_lists(x) for x in v.values()) if isinstance(v, dict) else True


def validate(doc: Any) -> list[Event]:
    """Check `doc` against the trace-event format's required fields, and against what
    viewers need to draw it right; return its events."""
    assert isinstance(doc, dict) and list(doc)[0] == "traceEvents"
    assert set(doc) <= {"traceEvents", "otherData"}  # Perfetto stops at an unknown key
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    slices: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    flows: dict[tuple[str, str, int], list[Event]] = defaultdict(list)
    for ev in events:
        assert isinstance(ev, dict), ev
        ph = ev.get("ph")
        assert ph in {"X", "i", "C", "M", "s", "f"}, ev
        for key in ("name", "ts", "pid", "tid"):
            assert key in ev, (key, ev)
        assert isinstance(ev["name"], str) and ev["name"], ev
        assert _number(ev["ts"]) and ev["ts"] >= 0, ev
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int), ev
        assert _no_lists(ev), ev  # Perfetto's tokenizer gives up at a list before "ts"
        assert list(ev).index("ts") < 4, ev
        if ph == "X":
            assert _number(ev.get("dur")) and ev["dur"] >= 0, ev
            slices[ev["pid"], ev["tid"]].append((ev["ts"], ev["ts"] + ev["dur"]))
        elif ph == "i":
            assert ev.get("s", "t") in {"g", "p", "t"}, ev
        elif ph == "C":
            assert isinstance(ev.get("args"), dict) and ev["args"], ev
            assert all(_number(v) for v in ev["args"].values()), ev
        elif ph == "M":
            assert ev["name"] in _METADATA, ev
            assert isinstance(ev.get("args"), dict) and _METADATA[ev["name"]] in ev["args"], ev
        else:
            assert isinstance(ev.get("id"), int) and isinstance(ev.get("cat"), str), ev
            flows[ev["cat"], ev["name"], ev["id"]].append(ev)
    for track, spans in slices.items():  # on one thread, slices nest or follow each other
        stack: list[tuple[float, float]] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1][1], (track, stack[-1], (start, end))
            stack.append((start, end))
    for key, pair in flows.items():
        assert sorted(e["ph"] for e in pair) == ["f", "s"], key
        s, f = sorted(pair, key=lambda e: e["ph"], reverse=True)
        assert f.get("bp") == "e" and f["ts"] >= s["ts"], key
        for e in (s, f):
            assert bound_slice(events, e) is not None, ("flow end in no slice", e)
    return events


def bound_slice(events: list[Event], flow_event: Event) -> Event | None:
    """The innermost slice of the flow event's thread that encloses its timestamp."""
    t = flow_event["ts"]
    around = [
        e
        for e in events
        if e["ph"] == "X"
        and e["pid"] == flow_event["pid"]
        and e["tid"] == flow_event["tid"]
        and e["ts"] <= t <= e["ts"] + e["dur"]
    ]
    return min(around, key=lambda e: e["dur"], default=None)


def test_the_validator_rejects_what_viewers_cannot_draw() -> None:
    def doc(*events: Event) -> dict[str, Any]:
        meta = {
            "ph": "M",
            "name": "process_name",
            "ts": 0,
            "pid": 1,
            "tid": 1,
            "args": {"name": "p"},
        }
        return {"traceEvents": [meta, *events]}

    x = {"ph": "X", "name": "a", "cat": "c", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    validate(doc(x, {**x, "ts": 2, "dur": 3}, {**x, "ts": 10}))  # nested, then after
    bad = [
        [{**x, "dur": -1}],
        [{k: v for k, v in x.items() if k != "dur"}],
        [{k: v for k, v in x.items() if k != "tid"}],
        [x, {**x, "ts": 5}],  # overlaps without nesting
        [{"ph": "C", "name": "n", "ts": 0, "pid": 1, "tid": 1, "args": {}}],
        [x, {"ph": "s", "name": "f", "cat": "flow", "ts": 1, "pid": 1, "tid": 1, "id": 1}],
        [{**x, "args": {"v": [1, 2]}}],
    ]
    for events in bad:
        with pytest.raises(AssertionError):
            validate(doc(*events))


# -- what the records say -------------------------------------------------------------------


@dataclasses.dataclass
class Truth:
    """The trace, spelled out by the reducer: what the export must show."""

    views: list[StepView]
    counts: list[tuple[int, int, int]]  # (free blocks, running, waiting) after each step
    names: dict[int, str]  # ref -> request id


def truth(path: Path) -> Truth:
    with TraceReader(path) as reader:
        state: State | None = None
        out = Truth([], [], {})
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Snapshot) and state is None:
                state = State.from_snapshot(reader.header, rec)
            elif isinstance(rec, Step):
                state = state or State.initial(reader.header)
                out.views.append(apply_with_view(state, rec))
                out.counts.append((len(state.free), len(state.running), len(state.waiting)))
                out.names.update(out.views[-1].names)
    return out


def us(ns: int) -> int:
    return (ns + 500) // 1000


def export(trace: Path, tmp_path: Path, name: str = "out.json") -> tuple[list[Event], Any]:
    out = tmp_path / name
    summary = export_perfetto(trace, out)
    doc = json.loads(out.read_text(encoding="utf-8"))
    events = validate(doc)
    assert summary.events == len(events)
    return events, doc


def threads(events: list[Event]) -> dict[str, int]:
    """Request id -> its thread id."""
    return {
        e["args"]["name"]: e["tid"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2
    }


def on(events: list[Event], tid: int, name: str, ph: str = "X") -> list[Event]:
    return sorted(
        (
            e
            for e in events
            if e["ph"] == ph and e["pid"] == 2 and e["tid"] == tid and e["name"] == name
        ),
        key=lambda e: e["ts"],
    )


def series(events: list[Event], name: str, key: str) -> list[float]:
    return [e["args"][key] for e in events if e["ph"] == "C" and e["name"] == name]


# -- the demo workload: preemptions, prefix hits, chunked prefill -----------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth, list[Event], Any]:
    tmp = tmp_path_factory.mktemp("export")
    path = write_trace(tmp, record(load_workload(demo_workload_path())).data)
    events, doc = export(path, tmp)
    return path, truth(path), events, doc


def test_the_demo_exports_valid_trace_event_json(demo: Any) -> None:
    _, t, events, doc = demo
    assert doc["otherData"]["steps"] == len(t.views)
    assert doc["otherData"]["clock"].startswith("recorded")
    assert "cut" not in doc["otherData"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"engine", "requests"}


def test_one_step_slice_per_step_from_the_previous_end_to_its_own(demo: Any) -> None:
    """Each step's slice ends at its end, and starts where the previous one ended, unless
    the engine waited before it (IDLE_MIN_NS or more): then it starts where its recorded
    work did, and an idle slice covers the wait."""
    _, t, events, _ = demo
    idle = {e["ts"] + e["dur"]: e["ts"] for e in events if e["ph"] == "X" and e["tid"] == 3}
    steps = sorted(
        (e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1),
        key=lambda e: e["ts"],
    )
    assert len(steps) == len(t.views)
    prev = 0
    for e, view in zip(steps, t.views):
        rec = view.record
        assert e["name"] == f"step {rec.step}" and e["args"]["step"] == rec.step
        start = prev
        if rec.time_ns - rec.work_ns - prev >= IDLE_MIN_NS:
            start = rec.time_ns - rec.work_ns
            assert idle.pop(us(start)) == us(prev)
        assert (e["ts"], e["ts"] + e["dur"]) == (us(start), us(rec.time_ns))
        assert e["args"]["scheduled_tokens"] == rec.num_scheduled_tokens
        assert e["args"]["token_budget"] == rec.token_budget
        assert e["args"]["schedule_ns"] == rec.schedule_ns
        assert e["args"]["preemptions"] == len(rec.preemptions)
        prev = rec.time_ns
    assert not idle
    phases = {e["name"] for e in events if e["ph"] == "X" and e["tid"] == 2 and e["pid"] == 1}
    assert phases == {"schedule", "update"}  # the simulated runner reports no timings


def test_every_request_has_queued_prefill_decode_and_finish(demo: Any) -> None:
    _, t, events, _ = demo
    tids = threads(events)
    assert sorted(tids) == sorted(t.names.values())
    assert [tids[t.names[r]] for r in sorted(t.names)] == sorted(tids.values())  # by arrival
    prefills: Counter[str] = Counter()
    decoded: Counter[str] = Counter()
    for view in t.views:
        for e in view.scheduled:
            if e.kind in (Kind.PREFILL, Kind.CHUNK):
                prefills[t.names[e.ref]] += 1
            else:
                decoded[t.names[e.ref]] += e.num_tokens
    for rid, tid in tids.items():
        assert len(on(events, tid, "queued")) == 1, rid
        chunks = on(events, tid, "prefill")
        assert len(chunks) == prefills[rid] >= 1, rid
        decodes = on(events, tid, "decode")
        assert decodes and sum(d["args"]["tokens"] for d in decodes) == decoded[rid], rid
        finish = on(events, tid, "finish", "i")
        assert len(finish) == 1 and finish[0]["args"]["reason"].startswith("FINISHED"), rid
        first = min(e["ts"] for e in events if e["ph"] == "X" and e["tid"] == tid)
        assert on(events, tid, "queued")[0]["ts"] == first  # queued comes first


def test_consecutive_decodes_merge_into_one_slice(demo: Any) -> None:
    _, t, events, _ = demo
    decoding: dict[str, list[int]] = defaultdict(list)
    for view in t.views:
        for e in view.scheduled:
            if e.kind == Kind.DECODE:
                decoding[t.names[e.ref]].append(view.record.step)
    tids = threads(events)
    for rid, steps in decoding.items():
        runs = 1 + sum(1 for a, b in zip(steps, steps[1:]) if b != a + 1)
        got = on(events, tids[rid], "decode")
        assert len(got) == runs, rid
        assert sum(d["args"]["steps"] for d in got) == len(steps)


def test_every_preemption_has_a_span_and_an_arrow_to_its_resumption(demo: Any) -> None:
    _, t, events, _ = demo
    tids = threads(events)
    preempted = [
        (view.record.step, t.names[p.victim]) for view in t.views for p in view.record.preemptions
    ]
    assert len(preempted) >= 3
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == len(preempted)
    arrows = []
    for fid, s in starts.items():
        step_slice = bound_slice(events, s)
        resumed = bound_slice(events, ends[fid])
        assert step_slice is not None and resumed is not None
        assert step_slice["pid"] == 1 and resumed["name"] == "prefill"
        assert resumed["args"]["resumed"] is True
        rid = next(r for r, tid in tids.items() if tid == resumed["tid"])
        arrows.append((step_slice["args"]["step"], rid))
        span = [
            p
            for p in on(events, resumed["tid"], "preempted")
            if p["args"]["step"] == step_slice["args"]["step"]
        ]
        assert len(span) == 1
        assert span[0]["ts"] == step_slice["ts"]  # preempted from the step that did it
        assert span[0]["ts"] + span[0]["dur"] == resumed["ts"]  # ...to the resumption
    assert sorted(arrows) == sorted(preempted)
    for rid, tid in tids.items():
        assert len(on(events, tid, "preempted")) == sum(1 for _, r in preempted if r == rid)


def test_counters_follow_the_records(demo: Any) -> None:
    _, t, events, _ = demo
    free = series(events, "KV", "free blocks")
    assert free[1:] == [v.record.free_blocks for v in t.views]
    with TraceReader(demo[0]) as reader:
        assert free[0] == reader.header.num_blocks - 1  # the empty pool, before step 0
    assert series(events, "queue", "running")[1:] == [c[1] for c in t.counts]
    assert series(events, "queue", "waiting")[1:] == [c[2] for c in t.counts]
    use = series(events, "budget", "use")
    assert len(use) == len(t.views)
    assert use == [round(v.record.num_scheduled_tokens / v.record.token_budget, 4) for v in t.views]
    assert max(use) <= 1.0


# -- other traces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [
        "c_kv_pressure_prefix",
        "e_priority_unschedule",
        "e_priority_self_preempt",
        "d_long_prefill_with_others",
    ],
)
def test_fidelity_cases_export_valid_and_complete(case: str, tmp_path: Path) -> None:
    run = record(load_workload(FIDELITY / f"{case}.workload.json"))
    path = write_trace(tmp_path, run.data)
    events, _ = export(path, tmp_path)
    t = truth(path)
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    assert len(steps) == len(t.views)
    preemptions = sum(len(v.record.preemptions) for v in t.views)
    assert sum(1 for e in events if e["name"] == "preempted") == preemptions
    assert sum(1 for e in events if e["ph"] == "s") == preemptions  # all resumed
    assert sum(1 for e in events if e["name"] == "finish") == len(t.names)


def test_speculative_decoding_is_one_decode_slice_with_draft_counts(tmp_path: Path) -> None:
    w = workload(
        [req("A", 40, max_tokens=12), req("B", 20, max_tokens=9)], num_speculative_tokens=2
    )
    path = write_trace(tmp_path, record(w).data)
    events, _ = export(path, tmp_path)
    t = truth(path)
    for rid, tid in threads(events).items():
        decodes = on(events, tid, "spec decode")  # named apart from plain decoding
        assert len(decodes) == 1 and not on(events, tid, "decode"), rid
        ref = next(r for r, n in t.names.items() if n == rid)
        spec = [e for v in t.views for e in v.scheduled if e.ref == ref and e.kind == Kind.SPEC]
        assert spec and decodes[0]["args"]["spec_tokens"] == sum(e.num_spec_tokens for e in spec)
        assert decodes[0]["args"]["tokens"] == sum(e.num_tokens for e in spec)
    # Each step slice counts its drafts apart from its decode tokens.
    steps = {e["args"]["step"]: e["args"] for e in events if e.get("cat") == "step"}
    for v in t.views:
        drafts = sum(e.num_spec_tokens for e in v.scheduled)
        args = steps[v.record.step]
        assert args.get("spec_tokens", 0) == drafts
        assert args.get("drafts_accepted", 0) == sum(a.accepted for a in v.record.spec_accepted)


def _record_with(
    tmp_path: Path, w: Any, act: Callable[[int, Any], None], attach_at: int = 0
) -> Path:
    """Record `w`, calling act(step, engine) before each step; the recorder attaches
    before step `attach_at` (> 0: mid-run, from a snapshot)."""
    engine = make_engine(w)
    recorder = None
    steps = run_steps(w, engine)
    step = 0
    while True:
        if step == attach_at:
            recorder = Recorder(engine, MemoryWriter(), RecorderOptions(strict=True))
        act(step, engine)
        if next(steps, None) is None:
            break
        step += 1
    engine.close()
    assert recorder is not None
    return write_trace(tmp_path, bytes(recorder.sink.data))


def test_aborts_end_the_request_where_it_was(tmp_path: Path) -> None:
    w = workload(
        [
            req("A", 64, max_tokens=40),
            req("B", 64, max_tokens=40),
            req("C", 300, max_tokens=4, arrival_step=1),
        ],
        max_num_seqs=2,
    )

    def act(step: int, engine: Any) -> None:
        if step == 3:
            engine.abort("A")  # running
            engine.abort("C")  # waiting: max_num_seqs keeps it out

    events, _ = export(_record_with(tmp_path, w, act), tmp_path)
    tids = threads(events)
    for rid in ("A", "C"):
        finish = on(events, tids[rid], "finish", "i")
        assert [f["args"]["reason"] for f in finish] == ["FINISHED_ABORTED"]
    queued = on(events, tids["C"], "queued")
    assert (
        queued
        and queued[0]["ts"] + queued[0]["dur"] == on(events, tids["C"], "finish", "i")[0]["ts"]
    )
    assert not on(events, tids["C"], "prefill")


def test_a_recording_attached_mid_run_starts_from_its_snapshot(tmp_path: Path) -> None:
    w = workload([req(f"R{i}", 50 + 10 * i, max_tokens=6, arrival_step=i) for i in range(6)])
    path = _record_with(tmp_path, w, lambda step, engine: None, attach_at=3)
    with TraceReader(path) as reader:
        assert reader.header.first_step == 3
    events, doc = export(path, tmp_path)
    assert doc["otherData"]["first_step"] == 3
    tids = threads(events)
    assert sorted(tids) == [f"R{i}" for i in range(6)]
    for rid in ("R0", "R1", "R2"):  # there before the recording: a finish, no arrival seen
        assert on(events, tids[rid], "finish", "i")


def rewrite(src: Path, dst: Path, change: Callable[[Step], Step]) -> Path:
    """`src` with every step record changed by `change` (and no footer: offsets moved)."""
    with TraceReader(src) as reader:
        parts = [preamble(), frame(*encode(reader.header))]
        for entry in reader.entries():
            if isinstance(entry.record, Step):
                parts.append(frame(*encode(change(entry.record))))
            elif isinstance(entry.record, Snapshot):
                parts.append(frame(*encode(entry.record)))
    dst.write_bytes(b"".join(parts))
    return dst


def test_a_trace_without_step_times_gets_one_millisecond_per_step(
    demo: Any, tmp_path: Path
) -> None:
    path = rewrite(
        demo[0],
        tmp_path / "untimed.trace",
        lambda s: dataclasses.replace(s, time_ns=0, schedule_ns=0, update_ns=0),
    )
    events, doc = export(path, tmp_path)
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    assert [(e["ts"], e["dur"]) for e in steps] == [(1000 * i, 1000) for i in range(len(steps))]
    assert doc["otherData"]["clock"].startswith("synthetic")
    engine = [e for e in events if e["name"] == "process_name" and e["pid"] == 1]
    assert len(engine) == 1 and "1 ms per step" in engine[0]["args"]["name"]


def test_runner_timings_land_on_the_step_they_measure(demo: Any, tmp_path: Path) -> None:
    kernels = (Kernel("attn_fwd", 30, 400_000), Kernel("matmul", 90, 900_000))

    def late_timing(s: Step) -> Step:  # step s carries the timings of step s - 1
        if s.step == 0:
            return s
        return dataclasses.replace(
            s,
            timings=(
                Timing(
                    s.step - 1, 20_000, 150_000, 60_000, 10_000, kernels if s.step % 10 == 1 else ()
                ),
            ),
        )

    path = rewrite(demo[0], tmp_path / "timed.trace", late_timing)
    events, _ = export(path, tmp_path)
    steps = {
        e["args"]["step"]: e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1
    }
    last = max(steps)
    for k, e in steps.items():
        if k == last:  # its timings would come with a step that never came
            assert "forward_ns" not in e["args"]
            continue
        assert (
            e["args"]["prepare_ns"],
            e["args"]["forward_ns"],
            e["args"]["attention_ns"],
            e["args"]["sample_ns"],
        ) == (20_000, 150_000, 60_000, 10_000)
        assert ("kernels" in e["args"]) == (k % 10 == 0)
    assert steps[10]["args"]["kernels"]["matmul"] == {"calls": 90, "total_ns": 900_000}
    phases = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 2]
    assert Counter(e["name"] for e in phases)["forward"] == last
    for e in phases:  # inside their step
        step = next(
            s
            for s in steps.values()
            if s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]
        )
        assert step is not None


def cut_inside_a_step_with_requests_left(path: Path) -> int:
    """A byte offset inside the step record that follows the first step to leave a request
    preempted and another never scheduled (so that the cut trace has both to show)."""
    with TraceReader(path) as reader:
        offsets = reader.index().step_offsets
        state = State.initial(reader.header)
        for i, rec in enumerate(reader.steps()):
            apply_with_view(state, rec)
            reqs = state.requests.values()
            if any(r.status == Status.PREEMPTED for r in reqs) and any(
                r.first_scheduled_step < 0 for r in reqs
            ):
                return offsets[i + 1] + 12
    raise AssertionError("the demo trace never leaves a request preempted")


def test_a_cut_trace_exports_its_whole_steps_and_says_so(demo: Any, tmp_path: Path) -> None:
    data = demo[0].read_bytes()
    cut = cut_inside_a_step_with_requests_left(demo[0])
    path = write_trace(tmp_path, data[:cut], "cut.trace")
    events, doc = export(path, tmp_path)
    assert "cut" in doc["otherData"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    assert len(steps) == doc["otherData"]["steps"] > 10
    unfinished = [e for e in events if e["ph"] == "X" and e.get("args", {}).get("unfinished")]
    finished = sum(1 for e in events if e["name"] == "finish")
    assert finished < len(threads(events))
    assert {e["name"] for e in unfinished} >= {"queued", "preempted"}
    end = max(e["ts"] + e["dur"] for e in steps)
    assert all(e["ts"] + e["dur"] == end for e in unfinished)


def test_an_open_reader_can_be_exported(demo: Any, tmp_path: Path) -> None:
    with TraceReader(demo[0]) as reader:
        summary = export_perfetto(reader, tmp_path / "r.json")
    assert summary.steps == len(demo[1].views) and summary.flows == summary.preemptions


# -- the command --------------------------------------------------------------------------------


def schedtop(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_cli_exports_and_says_what_it_wrote(demo: Any, tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    result = schedtop("export", str(demo[0]), "--perfetto", str(out))
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1 and str(out) in result.stdout
    assert f"{len(demo[2])} events" in result.stdout
    validate(json.loads(out.read_text(encoding="utf-8")))


@pytest.mark.parametrize(
    "problem", ["missing", "not a trace", "corrupt", "unwritable", "same file"]
)
def test_cli_bad_input_is_one_line_and_status_2(problem: str, demo: Any, tmp_path: Path) -> None:
    trace, out = str(demo[0]), tmp_path / "out.json"
    out.write_text("previous export")
    if problem == "missing":
        trace = str(tmp_path / "nope.trace")
    elif problem == "not a trace":
        trace = str(out)
    elif problem == "corrupt":  # whole until past the middle, then a bad checksum
        data = bytearray(demo[0].read_bytes())
        data[len(data) * 2 // 3] ^= 0xFF
        trace = str(write_trace(tmp_path, data, "bad.trace"))
    elif problem == "unwritable":
        out = tmp_path / "no-such-dir" / "out.json"
    else:
        out = demo[0]
    before = out.read_bytes() if out.exists() else None
    result = schedtop("export", trace, "--perfetto", str(out))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("schedtop: error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output
    assert (out.read_bytes() if out.exists() else None) == before  # left as it was
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind
