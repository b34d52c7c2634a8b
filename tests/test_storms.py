"""The incident list: every preemption, abort and error, checked against the Timeline's
own replay of the incident traces, and the storm summary of `schedtop stats`."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sim.workload import SimRequest
from recorder.reader import TraceReader
from recorder.schema import Status
from replays.storms import THRASH_STEPS, IncidentScan, scan, select
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.tui_support import demo_workload, fixed_trace

INCIDENTS = Path(__file__).resolve().parent.parent / "replays" / "incidents"
STORM = INCIDENTS / "preemption_storm.trace"


def test_every_preemption_with_victim_cause_and_pool() -> None:
    s = scan(str(STORM))
    tl = Timeline(open_reader(STORM))
    expected = []
    for step in range(tl.first_step, tl.last_step + 1):
        rec = tl.record(step)
        before = tl.state(step - 1)
        for p in rec.preemptions:
            victim = before.requests[p.victim]
            cause = "itself" if p.victim == p.for_request else before.request_id(p.for_request)
            free = len(before.free)
            expected.append((step, victim.request_id, cause, p.tokens_lost, free))
    got = [(i.step, i.request_id, i.cause, i.tokens_lost, i.free_before) for i in s.incidents]
    assert got == expected
    assert len(got) == 25  # the README's count
    first = s.incidents[0]
    assert (first.step, first.request_id, first.cause, first.count) == (4, "s15", "itself", 1)


def test_counts_and_thrash_flags() -> None:
    s = scan(str(INCIDENTS / "watermark_off.trace"))
    w04 = [i for i in s.incidents if i.request_id == "w04"]
    # The README: w04 preempted at 34, back in at 40, preempted again at 41.
    assert [(i.step, i.count) for i in w04] == [(34, 1), (41, 2)]
    assert w04[0].thrash == ""
    assert w04[1].thrash == "1 step after resuming"
    for i in s.incidents:
        if "after resuming" in i.thrash:
            assert i.count > 1 and int(i.thrash.split()[0]) <= THRASH_STEPS
    assert select(s.incidents, query="thrash") == tuple(i for i in s.incidents if i.thrash)


def test_select_sorts_and_filters() -> None:
    s = scan(str(STORM))
    by_lost = select(s.incidents, sort="lost", reverse=True)
    lost = [i.tokens_lost for i in by_lost]
    assert lost == sorted(lost, reverse=True)
    only = select(s.incidents, query="s15")
    assert only and all(i.request_id == "s15" or "s15" in i.cause for i in only)
    assert select(s.incidents, kinds=("abort", "error")) == ()


def test_summary_counts_recompute_against_all_computed_tokens() -> None:
    s = scan(str(STORM)).summary()
    tl = Timeline(open_reader(STORM))
    steps = range(tl.first_step, tl.last_step + 1)
    computed = sum(tl.record(i).num_scheduled_tokens for i in steps)
    lost = sum(p.tokens_lost for i in steps for p in tl.record(i).preemptions)
    assert (s.steps, s.preemptions, s.computed_tokens, s.tokens_lost) == (586, 25, computed, lost)
    assert abs(s.per_1k_steps - 25_000 / 586) < 1e-9
    assert s.top_victims[0][1] == max(n for _, n in s.top_victims)


def test_aborts_and_errors_are_listed(tmp_path: Path) -> None:
    w = demo_workload()
    too_long = SimRequest("too-long", 3, [7] * 3000, [], 4, 0)  # > max_model_len 2048
    trace = fixed_trace(tmp_path, dataclasses.replace(w, requests=[*w.requests, too_long]))
    tl = Timeline(open_reader(trace))
    ended = [
        (step, f.status)
        for step in range(tl.first_step, tl.last_step + 1)
        for f in tl.record(step).finishes
        if f.status in (Status.FINISHED_ABORTED, Status.FINISHED_ERROR)
    ]
    got = [(i.step, i.kind) for i in scan(str(trace)).incidents if i.kind != "preempt"]
    kinds = {Status.FINISHED_ABORTED: "abort", Status.FINISHED_ERROR: "error"}
    assert got == [(step, kinds[status]) for step, status in ended]
    assert ("too-long", "error") in {(i.request_id, i.kind) for i in scan(str(trace)).incidents}


def test_scan_in_slices_equals_one_scan() -> None:
    whole = scan(str(STORM)).incidents
    with TraceReader(STORM) as reader:
        sliced = IncidentScan(reader)
        while sliced.advance(50):
            pass
        assert sliced.incidents == whole and sliced.done


def test_stats_prints_the_storm_summary() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tui.cli", "stats", str(STORM)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "preempt per 1k   42.7 (25 in 586 steps)" in out
    assert "recompute lost" in out and "s15 ×3" in out


def test_a_step_record_without_its_step_is_a_trace_error(tmp_path: Path) -> None:
    """A hostile record is an error naming its offset, and the app's scan stops on it."""
    from recorder.encoding import unpack_body
    from recorder.errors import TraceError
    from tui.incidents import IncidentFeed

    storm = STORM.read_bytes()
    with TraceReader(STORM) as reader:
        offsets = list(reader.index().step_offsets)
        rtype, body = next((t, b) for o, t, b in reader.frames() if o == offsets[3])
    fields = unpack_body(body)
    del fields[0]  # the step number
    import msgpack

    from recorder.framing import FRAME, checksum

    new_body = msgpack.packb(fields)
    frame = FRAME.pack(len(new_body), rtype, checksum(rtype, new_body)) + new_body
    bad = tmp_path / "bad.trace"
    # Cut after a few more steps: with no footer, nothing points past the changed record.
    bad.write_bytes(storm[: offsets[3]] + frame + storm[offsets[4] : offsets[10]])
    with TraceReader(bad) as reader:
        with pytest.raises(TraceError, match="required field step") as e:
            IncidentScan(reader).advance()
        assert e.value.offset == offsets[3]
        feed = IncidentFeed(reader, live=False)
        while feed.busy:
            feed.step()
        assert "the scan stopped" in feed.view(10).error and not feed.busy
