"""Untrusted traces: truncations, bit flips, random bytes, hostile msgpack (huge declared
lengths, deep nesting, wrong types) and nonsense records. Whatever the input, reading it
and rebuilding state from it raise TraceError or nothing, and the memory a read takes
stays small.

SCHEDTOP_FUZZ_SCALE multiplies the number of examples (bench/fuzz_trace.py uses it for
long sessions); the default runs a little over 2,000 in a few seconds."""

from __future__ import annotations

import dataclasses
import os
import random
import tracemalloc
from functools import cache
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sim.workload import load_workload
from recorder.codec import encode
from recorder.errors import TraceError
from recorder.framing import PREAMBLE_SIZE, frame, preamble
from recorder.reader import TraceReader
from recorder.schema import (
    Admission,
    End,
    Finish,
    KVEvent,
    KVEvents,
    KVKind,
    Preemption,
    RecordType,
    Scheduled,
    Snapshot,
    Step,
)
from replays.reducer import apply, state_at
from replays.state import State
from tests.helpers import record

SCALE = int(os.environ.get("SCHEDTOP_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    """`examples` (times SCALE) examples, no deadline: tests never assert on wall time."""
    return settings(
        max_examples=examples * SCALE,
        deadline=None,
        derandomize=SCALE == 1,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


CASE = Path(__file__).parent / "data" / "fidelity" / "e_priority_preemption.workload.json"


@cache
def valid_trace() -> bytes:
    """A small real trace (preemptions, snapshots every 8 steps), and its records."""
    return record(load_workload(CASE), snapshot_interval=8).data


@cache
def valid_records() -> tuple[Any, ...]:
    with TraceReader.from_bytes(valid_trace()) as reader:
        return (reader.header, *(e.record for e in reader.entries()))


def read_everything(data: bytes) -> None:
    """What any consumer may do with a trace: open, iterate, index, seek, rebuild state.
    Anything but TraceError escaping is a bug."""
    try:
        reader = TraceReader.from_bytes(data)
    except TraceError:
        return
    with reader:
        state: State | None = None
        try:
            for entry in reader.entries():
                rec = entry.record
                if isinstance(rec, Snapshot):
                    state = State.from_snapshot(reader.header, rec)
                elif isinstance(rec, Step):
                    state = state or State.initial(reader.header)
                    apply(state, rec, entry.offset)
            if state is not None:
                state.check_invariants()
                state.to_snapshot()
        except TraceError:
            pass
        try:
            index = reader.index()
            for step in {
                index.first_step,
                (index.first_step + index.last_step) // 2,
                index.last_step,
            }:
                if index.first_step <= step <= index.last_step:
                    state_at(reader, step).to_snapshot()
        except TraceError:
            pass


# -- damaged real traces ---------------------------------------------------------------------


@fuzz(800)
@given(st.data())
def test_truncated_and_bit_flipped_traces(data: st.DataObject) -> None:
    raw = bytearray(valid_trace())
    for _ in range(data.draw(st.integers(0, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    read_everything(bytes(raw))


@fuzz(300)
@given(st.binary(max_size=2000), st.booleans())
def test_random_bytes(tail: bytes, with_preamble: bool) -> None:
    read_everything((preamble() if with_preamble else b"") + tail)


# -- hostile msgpack inside valid frames -------------------------------------------------------


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value of any type, nested a few levels (much faster to make than
    a recursive hypothesis strategy, which matters at thousands of examples)."""
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([rng.randrange(-(2**63), 2**64), rng.randrange(-3, 40)])
    if kind == 2:
        return rng.choice([rng.random() * 1e9, float("nan"), float("inf"), -0.0])
    if kind == 3:
        return "".join(rng.choice("ab\u00e9\u2603 \x00") for _ in range(rng.randrange(12)))
    if kind in (4, 5):
        return rng.randbytes(rng.choice([0, 1, 2, 3, 5, 9, 33, 65, rng.randrange(200)]))
    if kind in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(7))]
    return {
        rng.choice([rng.randrange(31), "k"]): random_value(rng, depth + 1)
        for _ in range(rng.randrange(9))
    }


BOMB_LIST = [
    b"\xdd\xff\xff\xff\xff",  # an array of 4 billion elements, then nothing
    b"\xdf\xff\xff\xff\xff",  # a map of 4 billion pairs
    b"\xdb\x7f\xff\xff\xff",  # a 2 GiB string
    b"\xc6\xff\xff\xff\xff",  # a 4 GiB bin
    b"\xc9\x00\x10\x00\x00\x01",  # an ext type
    b"\xd6\xff\x00\x00\x00\x00",  # a timestamp ext
    b"\x91" * 5000,  # arrays nested 5000 deep
    b"\x81\x00" * 3000,  # maps nested 3000 deep
    b"\xdc\x00\x40" + b"\xdc\x00\x40" * 900,  # 64-element arrays, 900 deep
    b"\xc1",  # a reserved byte
]
BOMBS = st.sampled_from(BOMB_LIST)


def hostile_body(draw: Any) -> bytes:
    """A record body: random msgpack, a bomb at a known key, a bomb inside an item list,
    or a record map whose known keys hold values of random types."""
    kind = draw(st.integers(0, 3))
    key = draw(st.integers(0, 24))
    rng = random.Random(draw(st.integers(0, 2**32)))
    if kind == 0:
        return msgpack.packb(random_value(rng))
    if kind == 1:
        return b"\x81" + msgpack.packb(key) + draw(BOMBS) + rng.randbytes(rng.randrange(8))
    if kind == 2:
        return msgpack.packb({0: 3, key: draw(BOMBS) + rng.randbytes(rng.randrange(8))})
    fields = {rng.randrange(25): random_value(rng) for _ in range(rng.randrange(10))}
    return msgpack.packb({0: 0, **fields})


def framed(body: bytes, where: str) -> bytes:
    """A trace whose checksums are right, so that `body` reaches the decoder as the
    header, a step, a snapshot or the footer."""
    if where == "header":
        return preamble() + frame(RecordType.HEADER, body)
    header_frame = frame(*encode(valid_records()[0]))
    raw = preamble() + header_frame + frame(RecordType[where.upper()], body)
    if where == "footer":  # an END record pointing at it makes readers decode it
        raw += frame(*encode(End(PREAMBLE_SIZE + len(header_frame))))
    return raw


PLACES = st.sampled_from(["header", "step", "snapshot", "footer"])


@fuzz(500)
@given(st.data())
def test_hostile_msgpack_in_valid_frames(data: st.DataObject) -> None:
    read_everything(framed(hostile_body(data.draw), data.draw(PLACES)))


def test_msgpack_bombs_take_little_memory() -> None:
    """Each bomb, at each place, read with the allocator watched."""
    for bomb in BOMB_LIST:
        for body in (
            b"\x81\x12" + bomb,
            msgpack.packb({0: 3, 18: bomb}),
            msgpack.packb({0: 3, 5: bomb}),
        ):
            for where in ("header", "step", "snapshot", "footer"):
                raw = framed(body, where)
                tracemalloc.start()
                try:
                    read_everything(raw)
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                assert peak < 16 << 20, f"{bomb[:8]!r} as {where}: {peak >> 20} MiB"


# -- well-formed records that make no sense -----------------------------------------------------

SMALL = st.integers(0, 12)


def nonsense(draw: Any, step: Step) -> Step:
    """The step with one field replaced by a random value of the right type."""
    field = draw(
        st.sampled_from(
            [
                "num_decodes",
                "running",
                "waiting",
                "free_blocks",
                "sample_counts",
                "kv_events",
                "finishes",
                "admissions",
                "preemptions",
                "scheduled",
                "step",
            ]
        )
    )
    if field == "kv_events":
        events = draw(
            st.lists(
                st.builds(
                    KVEvent,
                    st.integers(0, 4),
                    SMALL,
                    st.lists(st.integers(0, 40), max_size=4).map(tuple),
                    st.lists(st.binary(min_size=32, max_size=32), max_size=4).map(tuple),
                    SMALL,
                ),
                max_size=5,
            )
        )
        value: Any = KVEvents.of(
            [e if e.kind != KVKind.EVICTED else dataclasses.replace(e, ref=None) for e in events]
        )
    elif field in ("running", "waiting", "sample_counts"):
        value = tuple(draw(st.lists(SMALL, max_size=6)))
    elif field in ("num_decodes", "free_blocks", "step"):
        value = draw(st.integers(0, 400))
    else:
        value = tuple(draw(st.lists(ITEMS[field], max_size=3)))
    return dataclasses.replace(step, **{field: value})


ITEMS = {
    "finishes": st.builds(Finish, SMALL, st.integers(0, 7)),
    "admissions": st.builds(Admission, SMALL, SMALL, st.booleans()),
    "preemptions": st.builds(Preemption, SMALL, SMALL, SMALL, SMALL),
    "scheduled": st.builds(Scheduled, SMALL, SMALL, st.integers(0, 3), SMALL, SMALL),
}


@fuzz(500)
@given(st.data())
def test_nonsense_records_raise_trace_errors_in_the_reducer(data: st.DataObject) -> None:
    header, *records = valid_records()
    steps = [r for r in records if isinstance(r, Step)]
    victim = data.draw(st.integers(0, len(steps) - 1))
    state = State.initial(header)
    try:
        for i, step in enumerate(steps):
            apply(state, nonsense(data.draw, step) if i == victim else step)
        state.check_invariants()
        state.to_snapshot()
    except TraceError:
        pass
