"""The record encoding: every record type round-trips, and the format's growth rules hold
(unknown fields and trailing item elements are skipped)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.events import KVKind as EngineKVKind
from engine.records import HASH_BYTES, trace_hashes
from engine.records import Kind as EngineKind
from engine.records import Reason as EngineReason
from engine.request import Status as EngineStatus
from recorder import codec
from recorder.codec import decode, encode, pack_ints, unpack_ints
from recorder.encoding import Items
from recorder.errors import TraceError
from recorder.schema import (
    Admission,
    Arrival,
    Client,
    End,
    Finish,
    Footer,
    Header,
    Kernel,
    Kind,
    KVEvent,
    KVEvents,
    KVKind,
    Preemption,
    QueueStop,
    Reason,
    Record,
    RecordType,
    RequestState,
    Sample,
    SamplingParams,
    Scheduled,
    Shortfall,
    Snapshot,
    SpecAccepted,
    Status,
    Step,
    Timing,
)

H1, H2 = bytes(range(HASH_BYTES)), bytes(range(32, 32 + HASH_BYTES))  # as records keep them

HEADER = Header(
    engine="schedtop 0.1.0 (SimRunner)",
    model="SmolLM2-135M q8_0",
    config={
        "block_size": 16,
        "watermark": 0.01,
        "policy": "fcfs",
        "max_num_active_seqs": None,
        "enable_prefix_caching": True,
    },
    block_size=16,
    num_blocks=1024,
    policy="fcfs",
    start_time_ns=1_700_000_000 * 10**9,
    host="node-7",
    redacted=False,
    first_step=3,
    snapshot_interval=64,
)

STEP = Step(
    step=12,
    time_ns=123_456_789,
    schedule_ns=40_000,
    update_ns=9_000,
    token_budget=2048,
    arrivals=(
        Arrival(
            7,
            "req-7",
            5,
            -2,
            7.0,
            2,
            SamplingParams(32, 0.7, 0.9, 40, 1234, (2, 70000), True),
            (1, 2, 3, 65536, 2**40),
        ),
        Arrival(8, "req-8", 33, 0, 8.5, None, SamplingParams(4), None, (H1, H2)),
    ),
    num_decodes=3,
    scheduled=(
        Scheduled(7, 5, Kind.PREFILL, 0),
        Scheduled(4, 4, Kind.SPEC, 90, 3),
        Scheduled(8, 16, Kind.CHUNK, 16),
    ),
    admissions=(Admission(7, 0, False), Admission(8, 16, True)),
    preemptions=(Preemption(2, 4, 100, 1), Preemption(4, 4, 90)),
    shortfalls=(Shortfall(8, 17, 16, Reason.TOKEN_BUDGET),),
    running_stop=QueueStop(Reason.KV_BLOCKS, Reason.KV_BLOCKS),
    waiting_stop=QueueStop(Reason.WATERMARK, Reason.HEAD_OF_LINE),
    finishes=(Finish(1, Status.FINISHED_STOPPED), Finish(3, Status.FINISHED_ERROR, "too long")),
    sample_counts=(1, 1, 1, 1, 3, 0),
    sampled_tokens=(5, 6, 7, 8, 9, 10, 11),
    other_samples=(Sample(5, 2, (1, 2)), Sample(6, 1)),
    spec_accepted=(SpecAccepted(4, 2),),
    kv_events=KVEvents.of(
        [
            KVEvent(KVKind.EVICTED, None, (9, 10)),
            KVEvent(KVKind.ALLOCATED, 7, (9, 10, 300)),
            KVEvent(KVKind.PREFIX_HIT, 8, (1,), num_tokens=16),
            KVEvent(KVKind.CACHED, 8, (4, 5), (H1, H2)),
            KVEvent(KVKind.FREED, 2, (6, 5)),
        ]
    ),
    free_blocks_after_schedule=100,
    free_blocks=101,
    running=(4, 7),
    waiting=(8, 2),
    timings=(
        Timing(
            11,
            1000,
            2_000_000,
            500_000,
            3000,
            (Kernel("paged_attention", 30, 400_000), Kernel("gemm", 90, 1_500_000)),
        ),
        Timing(12, 900, 1_900_000, None, 2900),
    ),
)

SNAPSHOT = Snapshot(
    step=255,
    next_ref=9,
    requests=(
        RequestState(
            4, "req-4", Status.RUNNING, 80, 10, 89, (3, 4, 5, 6, 7, 8), 1, 0, 4.0, 16, 64, 2, 3, 5
        ),
        RequestState(8, "req-8", Status.WAITING, 33, 0, 0, (), 0, -1, 8.5, -1, 4),
    ),
    running=(4,),
    waiting=(8,),
    free_queue=(9, 10, 2, 1),
    cached_block_ids=(1, 3),
    cached_hashes=(H1, H2),
)

FOOTER = Footer(
    first_step=3,
    step_offsets=(40, 100, 4000, 2**33),
    snapshot_steps=(2, 5),
    snapshot_offsets=(12, 3000),
    num_steps=4,
    num_arrivals=9,
    num_finishes=2,
    num_preemptions=1,
    end_time_ns=5 * 10**9,
)


CLIENT = Client(
    after_step=41,
    time_ns=9_000_000_000,
    request_id="cmpl-1",
    endpoint="/v1/completions",
    status=200,
    finish_reason="abort",
    stream=True,
    prompt_tokens=12,
    completion_tokens=3,
    queue_ns=1_000,
    ttft_ns=50_000_000,
    e2e_ns=90_000_000,
    itl_ns=(20_000_000, 20_000_001),
)


@pytest.mark.parametrize(
    "record",
    [
        HEADER,
        STEP,
        Step(step=0),
        SNAPSHOT,
        FOOTER,
        End(12345),
        CLIENT,
        Client(-1, 0, "", "/v1/models", 401, message="no key"),
    ],
    ids=lambda r: type(r).__name__,
)
def test_every_record_type_round_trips(record: Record) -> None:
    rtype, body = encode(record)
    assert decode(rtype, body, 0) == record


def test_kv_columns_spell_out_the_events() -> None:
    events = STEP.kv_events.events()
    assert [e.kind for e in events] == [4, 0, 2, 3, 1]
    assert events[3] == KVEvent(KVKind.CACHED, 8, (4, 5), (H1, H2))
    assert events[2].num_tokens == 16 and events[0].ref is None
    assert KVEvents.of(events) == STEP.kv_events


@pytest.mark.parametrize("values", [(), (0,), (255,), (256, 1), (65536,), (2**32,), (2**64 - 1,)])
def test_int_arrays_pick_the_narrowest_width(values: tuple[int, ...]) -> None:
    packed = pack_ints(values)
    assert unpack_ints(packed) == values
    if values:
        assert len(packed) == 1 + len(values) * packed[0]


def test_negative_or_huge_ints_are_refused_when_writing() -> None:
    with pytest.raises(ValueError):
        pack_ints([-1])
    with pytest.raises(ValueError):
        pack_ints([2**64])


def test_unknown_keys_and_trailing_item_fields_are_skipped() -> None:
    """A newer minor version may add fields: old readers must read past them."""
    _, body = encode(STEP)
    fields = msgpack.unpackb(body, strict_map_key=False)
    fields[99] = ["anything", {"nested": 1}]
    item = msgpack.packb([1, 2, False, "a future field"])
    fields[8] = item  # admissions: one item with an extra trailing element
    decoded = decode(RecordType.STEP, msgpack.packb(fields), 0)
    assert isinstance(decoded, Step)
    assert decoded.admissions == (Admission(1, 2, False),)
    assert decoded.arrivals == STEP.arrivals


def test_longer_hashes_of_older_traces_read_as_their_first_bytes() -> None:
    """Traces before 1.3 kept SHA-256's 32 bytes: read, they compare with newer ones."""
    whole = (bytes(range(32)), bytes(range(100, 132)))
    snap = dataclasses.replace(SNAPSHOT, cached_hashes=whole)
    decoded = decode(RecordType.SNAPSHOT, encode(snap)[1], 0)
    assert isinstance(decoded, Snapshot)
    assert decoded.cached_hashes == tuple(h[:HASH_BYTES] for h in whole)
    assert decoded == dataclasses.replace(snap, cached_hashes=trace_hashes(whole))


def test_unknown_record_type_decodes_to_none() -> None:
    assert decode(77, msgpack.packb({0: 1}), 0) is None


@pytest.mark.parametrize(
    "body, message",
    [
        (msgpack.packb([1, 2]), "expected a map"),
        (msgpack.packb({1: 5}), "required field step"),
        (msgpack.packb({0: -1}), "step: expected an unsigned integer"),
        (msgpack.packb({0: 1, 8: b"\x93\x01"}), "admissions"),
        (msgpack.packb({0: 1, 18: [b"\x01\x00", b"", b"\x01\x02"]}), "do not add up"),
        (b"\xc1", "malformed msgpack"),
        (msgpack.packb({0: 1}) + b"\x00", "malformed msgpack"),
    ],
)
def test_malformed_bodies_name_the_field(body: bytes, message: str) -> None:
    with pytest.raises(TraceError, match=message) as info:
        decode(RecordType.STEP, body, 4242)
    assert info.value.offset == 4242 and "at byte 4242" in str(info.value)


def test_schema_enums_match_the_engine() -> None:
    """The format's enum values are the engine's today; the recorder writes ints."""
    for ours, theirs in [
        (Kind, EngineKind),
        (Reason, EngineReason),
        (Status, EngineStatus),
        (KVKind, EngineKVKind),
    ]:
        assert [(e.name, e.value) for e in ours] == [(e.name, e.value) for e in theirs]


def test_every_schema_record_has_a_codec() -> None:
    assert set(codec.BODIES) == {
        RecordType.HEADER,
        RecordType.STEP,
        RecordType.SNAPSHOT,
        RecordType.FOOTER,
        RecordType.CLIENT,
    }


# -- the steady-step encoder (recorder.vllm writes one a step with it) --------------------------

_counts = st.integers(min_value=0, max_value=2**40)
_tokens = st.lists(st.integers(min_value=0, max_value=2**33), max_size=40).map(tuple)


_block_ids = st.lists(st.integers(0, 70000), min_size=1, max_size=4).map(tuple)
_hash = st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES)


@st.composite
def _kv_event(draw: st.DrawFn) -> KVEvent:
    """Any event: a decode step's (allocated, cached) and the rarer ones, refs and block
    ids on either side of 256 (the hand-written steady encoder packs short columns)."""
    kind = draw(st.sampled_from(list(KVKind)))
    blocks = draw(_block_ids)
    ref = None if kind == KVKind.EVICTED else draw(st.integers(0, 300))
    hashes: tuple[bytes, ...] = ()
    if kind in (KVKind.CACHED, KVKind.EVICTED):
        hashes = tuple(draw(_hash) for _ in blocks)
    tokens = draw(st.integers(1, 1000)) if kind == KVKind.PREFIX_HIT else 0
    return KVEvent(kind, ref, blocks, hashes, tokens)


_kv_events = st.one_of(
    st.just(KVEvents()),
    st.lists(_kv_event(), max_size=8).map(KVEvents.of),
    # A decode step's shape: blocks allocated, then the full ones cached.
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 70000), _hash), max_size=20).map(
        lambda rows: KVEvents.of(
            [KVEvent(KVKind.ALLOCATED, r, (b,)) for r, b, _ in rows]
            + [KVEvent(KVKind.CACHED, r, (b,), (h,)) for r, b, h in rows]
        )
    ),
)


@st.composite
def _steady_fields(draw: st.DrawFn) -> tuple[object, ...]:
    # Over 64 tokens too: encode_steady packs a batch at width 2 on a path of its own,
    # which must widen as pack_ints does for an id of 65536 or more.
    n = draw(st.sampled_from([0, 1, 40, 64, 65, 70, 256]))
    top = draw(st.sampled_from([255, 65535, 70000]))
    tokens = draw(st.one_of(st.just(()), st.lists(st.integers(0, top), min_size=n, max_size=n)))
    kv = draw(_kv_events)
    return (
        draw(_counts),
        draw(_counts),
        draw(_counts),
        draw(_counts),
        draw(_counts),
        n,
        draw(st.sampled_from([None, (0,) * n])),
        tuple(tokens),
        kv,
        draw(_counts),
        draw(_counts),
        draw(_counts),  # work_ns
    )


@settings(max_examples=200, deadline=None)
@given(_steady_fields())
def test_the_steady_encoder_writes_the_bytes_of_the_general_one(fields: tuple) -> None:
    step = Step(**dict(zip(codec.STEADY_FIELDS, fields)))
    assert codec.encode_steady(*fields) == encode(step)[1]
    assert decode(RecordType.STEP, codec.encode_steady(*fields), 0) == step


def test_an_encoder_of_fields_out_of_order_is_refused() -> None:
    with pytest.raises(ValueError, match="field order"):
        codec.STEP.encoder_of(("time_ns", "step"))


_request_state = st.builds(
    RequestState,
    ref=st.integers(0, 70000),
    request_id=st.text(max_size=12),
    status=st.integers(0, 3),
    num_prompt_tokens=_counts,
    num_output_tokens=_counts,
    num_computed_tokens=_counts,
    block_ids=st.lists(st.integers(0, 70000), max_size=70).map(tuple),
    num_preemptions=st.integers(0, 5),
    priority=st.integers(-5, 5),
    arrival_time=st.floats(0, 1e9, allow_subnormal=False),  # (torch may flush them to 0)
    num_cached_tokens=st.integers(-1, 100),
    max_tokens=st.integers(1, 1000),
    # Trailing fields at their default (-1) are left out of an item: the rows so end at
    # different lengths.
    arrival_step=st.integers(-1, 3),
    first_scheduled_step=st.integers(-1, 3),
    first_token_step=st.integers(-1, 3),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(_request_state, max_size=40))
def test_snapshot_requests_are_written_as_items_one_by_one_would_be(
    requests: list[RequestState],
) -> None:
    """A snapshot's requests are encoded a column at a time: the bytes of the generic
    item list (one structure and msgpack call per request), so every reader reads them."""
    fast = {name: c for _, name, c in codec.SNAPSHOT.fields}["requests"]
    generic = Items(codec.REQUEST_SNAP)
    assert fast.enc(tuple(requests)) == generic.enc(tuple(requests))
    assert fast.dec(fast.enc(tuple(requests))) == tuple(requests)
