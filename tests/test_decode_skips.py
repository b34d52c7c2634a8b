"""Trace format 1.7: a step's implicit decodes may pass over running requests
(`decode_skips`), the compact form of vLLM's async step that does not schedule a request
whose last token is in flight. The reducer, the queueing analysis and resim must expand
it exactly as the spelled-out form (every entry after the skipped request explicit)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from recorder.codec import decode, encode
from recorder.reader import TraceReader
from recorder.schema import (
    FORMAT_MINOR,
    Admission,
    Arrival,
    Finish,
    Kind,
    Sample,
    SamplingParams,
    Scheduled,
    Snapshot,
    Status,
    Step,
)
from replays.queueing import decoders
from replays.reducer import apply, apply_with_view
from replays.state import Inconsistent, State
from tests.test_trace_codec import HEADER

ROOT = Path(__file__).resolve().parent.parent


def spelled_out(rec: Step, before: State) -> Step:
    """`rec` without decode_skips: the implicit decodes from the first request passed
    over on, as explicit DECODE entries (what the writer wrote before format 1.7)."""
    if not rec.decode_skips:
        return rec
    aborted = {f.ref for f in rec.finishes if f.status == Status.FINISHED_ABORTED}
    base = [r for r in before.running if r not in aborted]
    skips = set(rec.decode_skips)
    first = min(base.index(r) for r in skips)
    implicit = [r for r in base if r not in skips][: rec.num_decodes]
    explicit = tuple(
        Scheduled(ref, 1, Kind.DECODE, before.requests[ref].num_computed_tokens)
        for ref in implicit[first:]
    )
    return dataclasses.replace(
        rec,
        num_decodes=first,
        scheduled=explicit + rec.scheduled,
        decode_skips=(),
    )


def assert_same_replay(records: list[Step | Snapshot], header: object) -> int:
    """Applies `records` as written and spelled out to two states; they must agree after
    every step, as must the leading decodes the queueing analysis sees. Returns how many
    steps passed over a request."""
    compact = State.initial(header)  # type: ignore[arg-type]
    spelled = State.initial(header)  # type: ignore[arg-type]
    skipping = 0
    for rec in records:
        if isinstance(rec, Snapshot):
            assert State.from_snapshot(header, rec).to_snapshot() == compact.to_snapshot()  # type: ignore[arg-type]
            continue
        other = spelled_out(rec, spelled)
        if rec.decode_skips:
            skipping += 1
            assert decode(*encode(rec), 0) == rec  # key 28 round-trips
            # The queueing analysis's leading decodes: the spelled-out form's, then the
            # entries it spells out.
            added = other.scheduled[: len(other.scheduled) - len(rec.scheduled)]
            lead_spelled = [*decoders(other, spelled), *(e.ref for e in added)]
            assert list(decoders(rec, compact)) == lead_spelled
        view_a = apply_with_view(compact, rec)
        view_b = apply_with_view(spelled, other)
        assert view_a.scheduled == view_b.scheduled, rec.step
        assert view_a.samples == view_b.samples, rec.step
        assert compact.to_snapshot() == spelled.to_snapshot(), rec.step
    return skipping


def arrival(ref: int) -> Arrival:
    return Arrival(ref, f"r{ref}", 4, 0, float(ref), None, SamplingParams(max_tokens=8))


def three_running() -> State:
    """A state with three 4-token requests admitted and prefilled (refs 0, 1, 2)."""
    header = dataclasses.replace(HEADER, num_blocks=64, block_size=16, first_step=0)
    state = State.initial(header)
    admit = Step(
        step=0,
        arrivals=tuple(arrival(i) for i in range(3)),
        scheduled=tuple(Scheduled(i, 4, Kind.PREFILL, 0) for i in range(3)),
        admissions=tuple(Admission(i, 0, False) for i in range(3)),
        free_blocks=63,
        free_blocks_after_schedule=63,
    )
    apply(state, admit)
    return state


def test_a_skip_replays_as_the_spelled_out_step() -> None:
    # Three requests admitted and decoding; then a step that passes over the middle one
    # (its last token in flight), which finishes with a sample of the batch before.
    start = three_running()
    skip = Step(
        step=1,
        num_decodes=2,
        decode_skips=(1,),
        other_samples=(Sample(1, 1, (7,)),),
        sampled_tokens=(5, 6),
        sample_counts=None,
        finishes=(Finish(1, Status.FINISHED_LENGTH_CAPPED),),
        free_blocks=63,
        free_blocks_after_schedule=63,
    )
    a, b = start.copy(), start.copy()
    other = spelled_out(skip, b)
    assert other.num_decodes == 1 and [e.ref for e in other.scheduled] == [2]
    va, vb = apply_with_view(a, skip), apply_with_view(b, other)
    assert va.scheduled == vb.scheduled and va.samples == vb.samples
    assert a.to_snapshot() == b.to_snapshot()
    assert a.requests[2].num_computed_tokens == 5 and a.requests[0].num_computed_tokens == 5
    assert 1 not in a.requests


@pytest.mark.parametrize(
    ("skips", "num_decodes", "why"),
    [((5,), 2, "not running"), ((1, 1), 1, "not distinct"), ((1,), 3, "leading decodes")],
)
def test_a_skip_that_does_not_fit_the_state_is_an_error(
    skips: tuple[int, ...], num_decodes: int, why: str
) -> None:
    state = three_running()
    bad = Step(step=1, num_decodes=num_decodes, decode_skips=skips, free_blocks=63)
    with pytest.raises(Inconsistent, match=why):
        apply(state, bad)


def test_the_format_is_1_7_and_old_readers_skip_the_key() -> None:
    assert FORMAT_MINOR >= 7
    # Without skips the record is byte for byte what 1.6 wrote: the key (28) is left out.
    assert encode(Step(step=3, num_decodes=2))[1] == bytes([0x82, 0, 3, 6, 2])
    body = encode(Step(step=3, num_decodes=2, decode_skips=(1,)))[1]
    assert 28 in msgpack.unpackb(body, strict_map_key=False)


RECORD_CHURN = """
import sys
from pathlib import Path
import bench.vllm_record_bench as vb
b = vb.Bench(64, True, True, Path(sys.argv[1]), 4000, churn=True)
for _ in range(int(sys.argv[2])):
    b.step()
b.close()
"""


@pytest.mark.vllm
def test_vllm_async_churn_trace_replays_as_its_spelled_out_form(tmp_path: Path) -> None:
    """vLLM's AsyncScheduler in churn (a request finishes and one is admitted about every
    other step, vllm_record_bench's load): most steps pass over the request whose last
    token is in flight; the trace replays step for step as its spelled-out form,
    its snapshots (vLLM's own state) agree, and it re-simulates exactly."""
    from replays.resim import resimulate
    from tests.test_vllm import find_vllm_python, vllm_env

    env = vllm_env()
    env.pop("VLLM_TARGET_DEVICE")  # vLLM turns async scheduling off for the CPU target

    trace = tmp_path / "churn.trace"
    proc = subprocess.run(
        [find_vllm_python(), "-c", RECORD_CHURN, str(trace), "300"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with TraceReader(trace) as reader:
        header = reader.header
        assert "AsyncScheduler" in header.engine
        records = [e.record for e in reader.entries() if isinstance(e.record, Step | Snapshot)]
    skipping = assert_same_replay(records, header)  # type: ignore[arg-type]
    assert skipping > 50, skipping
    # Every recorded step re-simulates (the bench stops mid-run, its requests unfinished:
    # the re-simulation goes on past the last recorded step, where it is told apart).
    result = resimulate(trace)
    div = result.divergence
    assert div is None or (div.fields == ("steps",) and div.step == 300), div


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
