"""The trace format's tables: which record field has which key and codec, and records to
msgpack bodies and back (docs/trace-format.md is the specification; the machinery that
encodes and validates is recorder.encoding).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from engine.records import HASH_BYTES
from recorder.encoding import (
    BOOL,
    CONFIG,
    FLOAT,
    HASHES,
    INT,
    INTS,
    MAX_RECORD_BYTES,
    MAX_STR_LEN,
    OFFSETS,
    STR,
    UINT,
    Bad,
    Body,
    Codec,
    Items,
    Opt,
    Struct,
    _packer,
    begin_record,
    end_record,
    kind_of,
    pack_ints,
    unpack_body,
    unpack_ints,
)
from recorder.errors import TraceError
from recorder.schema import (
    NO_KV_EVENTS,
    Admission,
    Arrival,
    Client,
    End,
    Finish,
    Footer,
    Header,
    Kernel,
    KVEvents,
    KVKind,
    Preemption,
    QueueStop,
    Record,
    RecordType,
    RequestState,
    Sample,
    SamplingParams,
    Scheduled,
    Shortfall,
    SlotWrite,
    Snapshot,
    SpecAccepted,
    SpecProposed,
    Step,
    Timing,
)

__all__ = [
    "MAX_RECORD_BYTES",
    "MAX_STR_LEN",
    "STEADY_FIELDS",
    "decode",
    "encode",
    "encode_steady",
    "pack_ints",
    "unpack_ints",
]

# -- the format's tables --------------------------------------------------------------------------


class _Bias(Codec[tuple[tuple[int, float], ...]]):
    """logit_bias: an array of [token id, bias] pairs (SamplingParams checks the ranges)."""

    __slots__ = ()

    def enc(self, v: tuple[tuple[int, float], ...]) -> list[list[Any]]:
        return [[t, b] for t, b in v]

    def dec(self, v: Any) -> tuple[tuple[int, float], ...]:
        if type(v) is not tuple:
            raise Bad(f"expected an array of [token id, bias] pairs, got {kind_of(v)}")
        out = []
        for pair in v:
            if type(pair) is not tuple or len(pair) != 2:
                raise Bad("expected a [token id, bias] pair")
            out.append((UINT.dec(pair[0]), FLOAT.dec(pair[1])))
        return tuple(out)


class _Sampling(Struct[SamplingParams]):
    """SamplingParams, decoded once per distinct encoding: most requests of a run sample
    alike, and building one checks every range (a third of decoding an arrival, which a
    live view does for every request). Cached by value and by each value's type (True
    equals 1, and is not an unsigned integer); bias pairs, whose types nest, are not."""

    __slots__ = ("_seen",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._seen: dict[tuple[Any, ...], SamplingParams] = {}

    def dec(self, v: Any) -> SamplingParams:
        if type(v) is not tuple or len(v) > _BIAS_FIELD:
            return super().dec(v)
        key = (v, tuple(map(type, v)))
        params = self._seen.get(key)
        if params is None:
            params = super().dec(v)
            if len(self._seen) >= 256:
                self._seen.clear()
            self._seen[key] = params
        return params


SAMPLING = _Sampling(
    SamplingParams,
    [
        ("max_tokens", UINT),
        ("temperature", FLOAT),
        ("top_p", FLOAT),
        ("top_k", UINT),
        ("seed", Opt(INT)),
        ("stop_token_ids", INTS),
        ("ignore_eos", BOOL),
        # Logits processing: trailing, and at their defaults not written at all, so that a
        # trace of plain sampling is what it was; older readers skip them.
        ("presence_penalty", FLOAT),
        ("frequency_penalty", FLOAT),
        ("repetition_penalty", FLOAT),
        ("min_p", FLOAT),
        ("logit_bias", _Bias()),
        ("logprobs", Opt(UINT)),
    ],
    required=1,  # max_tokens: SamplingParams defaults it, the format does not
)
_BIAS_FIELD = SAMPLING.names.index("logit_bias")
ARRIVAL = Struct(
    Arrival,
    [
        ("ref", UINT),
        ("request_id", STR),
        ("num_prompt_tokens", UINT),
        ("priority", INT),
        ("arrival_time", FLOAT),
        ("eos_token_id", Opt(UINT)),
        ("sampling", SAMPLING),
        ("prompt_token_ids", Opt(INTS)),
        ("prompt_block_hashes", Opt(HASHES)),
        ("tenant", Opt(STR)),
    ],
)
SCHEDULED = Struct(
    Scheduled,
    [
        ("ref", UINT),
        ("num_tokens", UINT),
        ("kind", UINT),
        ("num_computed_before", UINT),
        ("num_spec_tokens", UINT),
    ],
)
ADMISSION = Struct(Admission, [("ref", UINT), ("cached_tokens", UINT), ("resumed", BOOL)])
SLOT_WRITE = Struct(SlotWrite, [("ref", UINT), ("position", UINT), ("runs", INTS)])
PREEMPTION = Struct(
    Preemption,
    [
        ("victim", UINT),
        ("for_request", UINT),
        ("tokens_lost", UINT),
        ("unscheduled_tokens", UINT),
        ("cause", UINT),
    ],
)
SHORTFALL = Struct(Shortfall, [("ref", UINT), ("wanted", UINT), ("got", UINT), ("reason", UINT)])
QUEUE_STOP = Struct(QueueStop, [("head", UINT), ("rest", UINT)])
FINISH = Struct(Finish, [("ref", UINT), ("status", UINT), ("message", STR)])
SAMPLE = Struct(Sample, [("ref", UINT), ("count", UINT), ("token_ids", Opt(INTS))])
SPEC_ACCEPTED = Struct(SpecAccepted, [("ref", UINT), ("accepted", UINT)])
SPEC_PROPOSED = Struct(SpecProposed, [("ref", UINT), ("count", UINT)])


_EVICTED, _CACHED, _PREFIX_HIT = KVKind.EVICTED, KVKind.CACHED, KVKind.PREFIX_HIT
_ONE_BYTE = b"\x01"


def _short(values: tuple[int, ...]) -> bytes:
    """pack_ints of at most 64 values that are nearly always below 256 (event kinds and
    sizes): one C call, which refuses anything else at once."""
    try:
        return _ONE_BYTE + bytes(values) if values else b""
    except (ValueError, TypeError):
        return pack_ints(values)


class _KVColumns(Struct[KVEvents]):
    """KVEvents, with the columns checked against each other."""

    __slots__ = ()

    def enc(self, v: KVEvents) -> list[Any]:
        # The generic encoding (every column packed, the trailing empty ones left out),
        # with fewer calls for the common shape of a decode step's events (blocks
        # allocated and cached, no prefix hits): a step's KV events were a third of the
        # cost of encoding a steady step's record.
        kinds, refs, sizes, blocks, hashes, hits = (
            v.kinds,
            v.refs,
            v.sizes,
            v.block_ids,
            v.hashes,
            v.hit_tokens,
        )
        if hits or not hashes or len(kinds) > 64 or type(kinds) is not tuple:
            return super().enc(v)
        return [
            _short(kinds),
            pack_ints(refs),
            _short(sizes),
            pack_ints(blocks),
            HASHES.enc(hashes),
        ]

    def dec(self, v: Any) -> KVEvents:
        if type(v) is tuple and 4 <= len(v) <= 5:
            plain = _plain_kv(v)
            if plain is not None:
                return plain
        kv = super().dec(v)  # the general path, which names a column that is wrong
        kinds, sizes = kv.kinds, kv.sizes
        if len(sizes) != len(kinds) or sum(sizes) != len(kv.block_ids):
            raise Bad("event kinds, sizes and blocks do not add up")
        if kinds and max(kinds) > _EVICTED:
            raise Bad(f"unknown event kind {max(kinds)}")
        with_ref = len(kinds) - kinds.count(_EVICTED)
        cached = sum([n for k, n in zip(kinds, sizes) if k == _CACHED])
        if (
            len(kv.refs) != with_ref
            or len(kv.hashes) != cached
            or len(kv.hit_tokens) != kinds.count(_PREFIX_HIT)
        ):
            raise Bad("event refs, hashes or hit tokens do not match the event kinds")
        return kv


# A step's KV event kinds and sizes, checked, by their encoding: (kinds, sizes, blocks,
# events with a request, cached blocks). Decode steps repeat a few shapes (a block
# allocated, cached, evicted), so most steps skip unpacking and checking them.
_Shape = tuple[tuple[int, ...], tuple[int, ...], int, int, int]
_SHAPES: dict[tuple[bytes, bytes], _Shape] = {}


def _plain_kv(v: tuple[Any, ...]) -> KVEvents | None:
    """The KV columns of a step with no prefix hits (the usual four or five), with the
    general path's checks but without its per-column codec calls: a live view decodes
    thousands of steps a second. None when anything is not what it should be: the
    general path then says what."""
    kinds_b, refs_b, sizes_b, blocks_b = v[0], v[1], v[2], v[3]
    hashes_b = v[4] if len(v) == 5 else b""
    if not (
        type(kinds_b) is bytes
        and type(refs_b) is bytes
        and type(sizes_b) is bytes
        and type(blocks_b) is bytes
        and type(hashes_b) is bytes
    ):
        return None
    key = (kinds_b, sizes_b)
    shape = _SHAPES.get(key)
    try:
        if shape is None:
            kinds, sizes = unpack_ints(kinds_b), unpack_ints(sizes_b)
            if (
                len(sizes) != len(kinds)
                or (kinds and max(kinds) > _EVICTED)
                or _PREFIX_HIT in kinds
            ):
                return None
            shape = (
                kinds,
                sizes,
                sum(sizes),
                len(kinds) - kinds.count(_EVICTED),
                sum([n for k, n in zip(kinds, sizes) if k == _CACHED]),
            )
            if len(kinds_b) <= 65:  # (short columns only: a bound on what is kept)
                if len(_SHAPES) >= 1024:
                    _SHAPES.clear()
                _SHAPES[key] = shape
        kinds, sizes, num_blocks, with_ref, cached = shape
        refs, blocks = unpack_ints(refs_b), unpack_ints(blocks_b)
        hashes = HASHES.dec(hashes_b) if hashes_b else ()
    except Bad:
        return None
    if len(refs) != with_ref or len(blocks) != num_blocks or len(hashes) != cached:
        return None
    return KVEvents(kinds, refs, sizes, blocks, hashes)


KV_EVENTS = _KVColumns(
    KVEvents,
    [
        ("kinds", INTS),
        ("refs", INTS),
        ("sizes", INTS),
        ("block_ids", INTS),
        ("hashes", HASHES),
        ("hit_tokens", INTS),
    ],
)
KERNEL = Struct(Kernel, [("name", STR), ("calls", UINT), ("total_ns", UINT)])
TIMING = Struct(
    Timing,
    [
        ("step", UINT),
        ("prepare_ns", UINT),
        ("forward_ns", UINT),
        ("attention_ns", Opt(UINT)),
        ("sample_ns", UINT),
        ("kernels", Items(KERNEL)),
        ("propose_ns", UINT),
    ],
)
REQUEST_SNAP = Struct(
    RequestState,
    [
        ("ref", UINT),
        ("request_id", STR),
        ("status", UINT),
        ("num_prompt_tokens", UINT),
        ("num_output_tokens", UINT),
        ("num_computed_tokens", UINT),
        ("block_ids", INTS),
        ("num_preemptions", UINT),
        ("priority", INT),
        ("arrival_time", FLOAT),
        ("num_cached_tokens", INT),
        ("max_tokens", UINT),
        ("arrival_step", INT),
        ("first_scheduled_step", INT),
        ("first_token_step", INT),
    ],
)


class _RequestItems(Items[RequestState]):
    """A snapshot's requests: the bytes Items writes, made a column at a time. Item by
    item (a structure's encoder, a msgpack call each) they were a fifth of a snapshot's
    cost at 256 requests; here the only per-request call packs the block table.
    decode is Items'."""

    __slots__ = ()

    def enc(self, v: tuple[RequestState, ...]) -> bytes:
        n = len(v)
        item = self.item
        if n < 2 or n > 0xFFFF:
            return super().enc(v)
        cols = list(zip(*map(item._values, v)))
        cols[_BLOCK_IDS] = tuple(map(_short_ints, cols[_BLOCK_IDS]))  # pack_ints' bytes
        rows: list[Any] = list(zip(*cols))
        if _TRIMMED in cols[-1]:
            # Struct.enc leaves out trailing fields at their defaults (-1: not yet).
            rows = [row if row[-1] != _TRIMMED else item.enc(r) for row, r in zip(rows, v)]
        # One array of the items is an array header and then each item as Items writes
        # it: the header (3 bytes for 16 to 65,535 items) is cut off.
        return _packer.pack(rows)[1 if n < 16 else 3 :]  # type: ignore[no-any-return]


_BLOCK_IDS = REQUEST_SNAP.names.index("block_ids")
_TRIMMED = REQUEST_SNAP.defaults[-1]
# Every field after the required ones defaults to -1, and block_ids is the only field
# with a codec of its own: what _RequestItems.enc relies on.
assert set(REQUEST_SNAP.defaults[REQUEST_SNAP.required :]) == {_TRIMMED} == {-1}
assert [i for i, _ in REQUEST_SNAP._custom] == [_BLOCK_IDS]

HEADER = Body(
    Header,
    [
        (0, "engine", STR),
        (1, "model", STR),
        (2, "config", CONFIG),
        (3, "block_size", UINT),
        (4, "num_blocks", UINT),
        (5, "policy", STR),
        (6, "start_time_ns", UINT),
        (7, "host", STR),
        (8, "redacted", BOOL),
        (9, "first_step", UINT),
        (10, "snapshot_interval", UINT),
        (11, "snapshot_work", UINT),
        (12, "arrival_origin_ns", Opt(INT)),
        (13, "kv_pool", STR),
        (14, "slot_map", BOOL),
    ],
)


class _StepBody(Body[Step]):
    """The step record's table, with a path of its own for a steady decode step's body
    (the fields STEADY_FIELDS names but sample_counts, the usual record of a busy
    engine): a live view decodes thousands of them a second, and the general loop calls
    a codec per field."""

    def decode(self, body: bytes) -> Step:
        obj = unpack_body(body)
        if type(obj) is dict and obj.keys() <= _PLAIN_KEYS:
            step = _plain_step(obj)
            if step is not None:
                return step
        return self.decode_map(obj)  # the general path, which names what is wrong


STEP = _StepBody(
    Step,
    [
        (0, "step", UINT),
        (1, "time_ns", UINT),
        (2, "schedule_ns", UINT),
        (3, "update_ns", UINT),
        (4, "token_budget", UINT),
        (5, "arrivals", Items(ARRIVAL)),
        (6, "num_decodes", UINT),
        (7, "scheduled", Items(SCHEDULED)),
        (8, "admissions", Items(ADMISSION)),
        (9, "preemptions", Items(PREEMPTION)),
        (10, "shortfalls", Items(SHORTFALL)),
        (11, "running_stop", Opt(QUEUE_STOP)),
        (12, "waiting_stop", Opt(QUEUE_STOP)),
        (13, "finishes", Items(FINISH)),
        (14, "sample_counts", Opt(INTS)),
        (15, "sampled_tokens", Opt(INTS)),
        (16, "other_samples", Items(SAMPLE)),
        (17, "spec_accepted", Items(SPEC_ACCEPTED)),
        (18, "kv_events", KV_EVENTS),
        (19, "free_blocks_after_schedule", UINT),
        (20, "free_blocks", UINT),
        (21, "running", Opt(INTS)),
        (22, "waiting", Opt(INTS)),
        (23, "timings", Items(TIMING)),
        (24, "spec_proposed", Items(SPEC_PROPOSED)),
        (25, "work_ns", UINT),
        (26, "free_slots", UINT),
        (27, "cached_slots", UINT),
        (28, "decode_skips", INTS),
        (29, "evicted_slots", UINT),
        (30, "slot_allocs", INTS),
        (31, "slot_writes", Items(SLOT_WRITE)),
        (32, "slots_freed_first", INTS),
        (33, "slots_freed", INTS),
        (34, "evictable_slots", UINT),
    ],
)
# The fields of a steady decode step's record (StepCompactor._decodes_only), in field
# order; the rest hold their defaults. encode_steady(*values) encodes such a step as
# encode(Step(...)) does, without building it (the recorder inside vLLM writes one a step).
STEADY_FIELDS = (
    "step",
    "time_ns",
    "schedule_ns",
    "update_ns",
    "token_budget",
    "num_decodes",
    "sample_counts",
    "sampled_tokens",
    "kv_events",
    "free_blocks_after_schedule",
    "free_blocks",
    "work_ns",
)
_STEP_KEYS = {name: key for key, name, _ in STEP.fields}
# The keys _plain_step decodes: a steady step's but sample_counts (14).
_PLAIN_KEYS = frozenset((0, 1, 2, 3, 4, 6, 15, 18, 19, 20, 25))
_UINTS = (0, 1, 2, 3, 4, 6, 19, 20, 25)  # its unsigned scalars (step is required)


def _plain_step(obj: dict[Any, Any]) -> Step | None:
    """The Step of a body whose keys are all in _PLAIN_KEYS, with every check the
    general path makes; None when one fails (the general path then says which)."""
    get = obj.get
    scalars = [get(key, 0) for key in _UINTS]
    if (
        0 not in obj
        or set(map(type, scalars)) != {int}
        or min(scalars) < 0
        or set(map(type, obj)) != {int}  # True == 1: the general path skips such keys
    ):
        return None
    sampled = get(15)
    kv = get(18)
    try:
        step = Step(scalars[0], scalars[1], scalars[2], scalars[3], scalars[4])
        step.num_decodes = scalars[5]
        if sampled is not None:
            step.sampled_tokens = INTS.dec(sampled)
        if kv is not None:
            step.kv_events = KV_EVENTS.dec(kv)
        step.free_blocks_after_schedule = scalars[6]
        step.free_blocks = scalars[7]
        step.work_ns = scalars[8]
        return step
    except Bad:
        return None


# encode_steady writes these keys by hand: the table above is what they must be.
assert [_STEP_KEYS[name] for name in STEADY_FIELDS] == [0, 1, 2, 3, 4, 6, 14, 15, 18, 19, 20, 25]


def encode_steady(
    step: int,
    time_ns: int,
    schedule_ns: int,
    update_ns: int,
    token_budget: int,
    num_decodes: int,
    sample_counts: tuple[int, ...] | None,
    sampled_tokens: tuple[int, ...] | None,
    kv_events: KVEvents,
    free_blocks_after_schedule: int,
    free_blocks: int,
    work_ns: int,
) -> bytes:
    """The body `encode` makes of a Step whose fields but STEADY_FIELDS hold their
    defaults (a steady decode step, written once a step): the same map, built field by
    field rather than by the table's loop (what is left out is what equals its default:
    0, None, no KV events), which compares and calls a codec for every field.
    tests/test_trace_codec.py checks the bytes against encode's.

    Written out in one function for the common shapes (a batch of sampled tokens; KV
    events that allocate and cache blocks): right after an engine's step this code and
    its data are out of the CPU's caches, where each call and look-up costs several
    times what it does in a loop (measured: docs/benchmarks.md, Recorder)."""
    body: dict[int, Any] = {0: step}
    if time_ns:
        body[1] = time_ns
    if schedule_ns:
        body[2] = schedule_ns
    if update_ns:
        body[3] = update_ns
    if token_budget:
        body[4] = token_budget
    if num_decodes:
        body[6] = num_decodes
    if sample_counts is not None:
        body[14] = pack_ints(sample_counts)
    if sampled_tokens is not None:
        # pack_ints' first try for more than 64 values (width 2), without its steps.
        pack = _U16_PACKS.get(len(sampled_tokens))
        if pack is None:
            body[15] = _first_tokens(sampled_tokens)
        else:
            try:
                body[15] = _TWO_BYTES + pack(*sampled_tokens)
            except struct.error:  # a token id of 65536 or more: pack_ints widens
                body[15] = pack_ints(sampled_tokens)
    kinds = kv_events.kinds
    if kinds:
        hashes = kv_events.hashes
        if (
            hashes
            and not kv_events.hit_tokens
            and type(kinds) is tuple
            and len(kinds) <= 64
            and type(kv_events.sizes) is tuple
        ):
            # _KVColumns.enc's shape of a decode step's events (blocks allocated and
            # cached), inline: kinds and sizes are below 256, one byte each.
            try:
                packed_kinds, packed_sizes = bytes(kinds), bytes(kv_events.sizes)
            except (ValueError, TypeError):
                body[18] = KV_EVENTS.enc(kv_events)
            else:
                body[18] = [
                    _ONE_BYTE + packed_kinds,
                    _short_ints(kv_events.refs),
                    _ONE_BYTE + packed_sizes,
                    _short_ints(kv_events.block_ids),
                    _short_hashes(hashes),
                ]
        else:
            body[18] = KV_EVENTS.enc(kv_events)
    elif kv_events is not NO_KV_EVENTS and kv_events != NO_KV_EVENTS:
        body[18] = KV_EVENTS.enc(kv_events)
    if free_blocks_after_schedule:
        body[19] = free_blocks_after_schedule
    if free_blocks:
        body[20] = free_blocks
    if work_ns:
        body[25] = work_ns
    return _packer.pack(body)  # type: ignore[no-any-return]


def _short_ints(values: tuple[int, ...]) -> bytes:
    """pack_ints of a short column (a decode step's refs or block ids, one per request
    crossing a block boundary; a snapshot's block tables), with one test of the top
    value and one C call: pack_ints' steps (the record's integer budget, the width loop,
    the packer's look-up by a tuple) took twice what packing 32 values does. A column of
    at most 64 needs no budget (the frame's size limit bounds the record); longer ones
    go to pack_ints."""
    n = len(values)
    top = max(values) if 0 < n <= 64 else -1
    if 0 <= top < 0x100:
        return _ONE_BYTE + bytes(values)
    if 0 <= top < 0x10000:
        pack = _U16_SHORT[n]
        if pack is None:
            pack = _U16_SHORT[n] = struct.Struct(f"<{n}H").pack
        try:
            return _TWO_BYTES + pack(*values)
        except struct.error:  # a negative value: pack_ints says so
            pass
    return pack_ints(values)


def _short_hashes(hashes: tuple[bytes, ...]) -> bytes:
    """HASHES.enc of a decode step's few cached blocks' hashes, HASH_BYTES long each (the
    engine's trace hashes): the same bytes with fewer steps (13k instructions for 16)."""
    try:
        if set(map(len, hashes)) == _HASH_LENGTH:
            return _HASH_SIZE + b"".join(hashes)
    except TypeError:  # hashes computed on first use (recorder.vllm): HASHES.enc's way
        pass
    return HASHES.enc(hashes)


_HASH_LENGTH = {HASH_BYTES}
_HASH_SIZE = bytes((HASH_BYTES,))

# _short_ints' packers at width 2, by count (1 to 64).
_U16_SHORT: list[Callable[..., bytes] | None] = [None] * 65
# encode_steady's packers of a step's sampled tokens at width 2, by count (over 64).
_U16_PACKS: dict[int, Callable[..., bytes]] = {}
_TWO_BYTES = b"\x02"


def _first_tokens(tokens: tuple[int, ...]) -> bytes:
    """pack_ints of `tokens` the first time a step has this many: makes the packer."""
    n = len(tokens)
    if 64 < n <= 1024:  # the common batch sizes; pack_ints caches no more either
        _U16_PACKS[n] = struct.Struct(f"<{n}H").pack
    return pack_ints(tokens)


SNAPSHOT = Body(
    Snapshot,
    [
        (0, "step", INT),
        (1, "next_ref", UINT),
        (2, "requests", _RequestItems(REQUEST_SNAP)),
        (3, "running", INTS),
        (4, "waiting", INTS),
        (5, "free_queue", INTS),
        (6, "cached_block_ids", INTS),
        (7, "cached_hashes", HASHES),
        (8, "slot_rows", Items(SLOT_WRITE)),
        (9, "free_slot_runs", INTS),
        (10, "evictable_slots", UINT),
    ],
)
FOOTER = Body(
    Footer,
    [
        (0, "first_step", UINT),
        (1, "step_offsets", OFFSETS),
        (2, "snapshot_steps", INTS),
        (3, "snapshot_offsets", OFFSETS),
        (4, "num_steps", UINT),
        (5, "num_arrivals", UINT),
        (6, "num_finishes", UINT),
        (7, "num_preemptions", UINT),
        (8, "end_time_ns", UINT),
        (9, "stopped", STR),
    ],
)

CLIENT = Body(
    Client,
    [
        (0, "after_step", INT),
        (1, "time_ns", UINT),
        (2, "request_id", STR),
        (3, "endpoint", STR),
        (4, "status", UINT),
        (5, "finish_reason", STR),
        (6, "stream", BOOL),
        (7, "prompt_tokens", UINT),
        (8, "completion_tokens", UINT),
        (9, "queue_ns", Opt(UINT)),
        (10, "ttft_ns", Opt(UINT)),
        (11, "e2e_ns", UINT),
        (12, "itl_ns", INTS),
        (13, "message", STR),
        (14, "parent_id", STR),
    ],
)

BODIES: dict[int, Body[Any]] = {
    RecordType.HEADER: HEADER,
    RecordType.STEP: STEP,
    RecordType.SNAPSHOT: SNAPSHOT,
    RecordType.FOOTER: FOOTER,
    RecordType.CLIENT: CLIENT,
}
TYPES: dict[type, RecordType] = {
    Header: RecordType.HEADER,
    Step: RecordType.STEP,
    Snapshot: RecordType.SNAPSHOT,
    Footer: RecordType.FOOTER,
    End: RecordType.END,
    Client: RecordType.CLIENT,
}

# The END body is always this 11-byte map {0: uint64}, so that the record has a fixed size.
_END_PREFIX = b"\x81\x00\xcf"
END_BODY_SIZE = len(_END_PREFIX) + 8


def encode(record: Record) -> tuple[RecordType, bytes]:
    """A record's type tag and msgpack body."""
    if isinstance(record, End):
        return RecordType.END, _END_PREFIX + record.footer_offset.to_bytes(8, "big")
    rtype = TYPES[type(record)]
    begin_record()
    try:
        return rtype, BODIES[rtype].encode(record)
    finally:
        end_record()


def decode(rtype: int, body: bytes, offset: int) -> Record | None:
    """The record in `body`, None for a type this reader does not know (skip it)."""
    begin_record()
    try:
        if rtype == RecordType.END:
            return _decode_end(body)
        codec = BODIES.get(rtype)
        return None if codec is None else codec.decode(body)
    except Bad as e:
        name = RecordType(rtype).name.lower()
        raise TraceError(f"{name} record: {e.message()}", offset) from None
    finally:
        end_record()


def _decode_end(body: bytes) -> End:
    obj = unpack_body(body)
    if type(obj) is not dict:
        raise Bad(f"expected a map, got {kind_of(obj)}")
    return End(UINT.dec(obj.get(0)))
