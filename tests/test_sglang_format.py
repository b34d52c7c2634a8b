"""Trace format 1.5 (issue 29) without SGLang: a token pool's header and step keys, the
retraction cause, and that what older readers get is unchanged; the plugin's refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import pytest

from recorder.codec import decode, encode
from recorder.schema import FORMAT_MINOR, Header, Preemption, Reason, RecordType, Step
from recorder.sglang import UnsupportedSglang, check_version, stub_vllm_custom_ops

HEADER = Header(
    engine="SGLang 0.5.23 (Scheduler)",
    model="m",
    config={"max_num_seqs": 8},
    block_size=1,
    num_blocks=1025,
    policy="fcfs",
    start_time_ns=1,
    host="h",
    redacted=False,
    kv_pool="tokens",
)
STEP = Step(
    step=3,
    preemptions=(Preemption(2, 2, 40, cause=Reason.RETRACTED),),
    free_blocks=1024,
    free_slots=700,
    cached_slots=96,
)


def test_token_pool_fields_round_trip() -> None:
    assert FORMAT_MINOR >= 5  # the token pool fields arrived in 1.5
    assert decode(RecordType.HEADER, encode(HEADER)[1], 0) == HEADER
    assert decode(RecordType.STEP, encode(STEP)[1], 0) == STEP


def test_older_records_read_with_the_defaults() -> None:
    """A 1.4 writer wrote none of the new keys: blocks, no slots, preemptions for blocks."""
    header = msgpack.unpackb(encode(HEADER)[1], strict_map_key=False)
    del header[13]
    old = decode(RecordType.HEADER, msgpack.packb(header), 0)
    assert isinstance(old, Header) and old.kv_pool == "blocks"
    step = msgpack.unpackb(encode(STEP)[1], strict_map_key=False)
    del step[26], step[27]
    step[9] = msgpack.packb([2, 2, 40])  # a 1.4 Preemption: three fields
    old_step = decode(RecordType.STEP, msgpack.packb(step), 0)
    assert isinstance(old_step, Step)
    assert old_step.free_slots == 0 and old_step.cached_slots == 0
    assert old_step.preemptions == (Preemption(2, 2, 40),)
    assert old_step.preemptions[0].cause == Reason.KV_BLOCKS


def test_default_fields_cost_no_bytes() -> None:
    """Records of vLLM and schedtop's engine are byte for byte what 1.4 wrote."""
    plain = Step(step=3, preemptions=(Preemption(2, 2, 40),), free_blocks=1024)
    body = msgpack.unpackb(encode(plain)[1], strict_map_key=False)
    assert 26 not in body and 27 not in body
    assert msgpack.unpackb(body[9]) == [2, 2, 40]


def test_other_sglang_versions_are_refused_by_name() -> None:
    check_version("0.5.23")
    with pytest.raises(UnsupportedSglang, match=r"SGLang 0\.5\.23, not 0\.5\.22"):
        check_version("0.5.22")


def test_the_custom_ops_stub_never_shadows_a_real_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {
        name: sys.modules.pop(name) for name in ("vllm", "vllm._custom_ops") if name in sys.modules
    }
    try:
        monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
        stub_vllm_custom_ops()
        from vllm._custom_ops import rotary_embedding  # type: ignore[import-not-found]

        with pytest.raises(RuntimeError, match="stub"):
            rotary_embedding()
    finally:
        for name in ("vllm", "vllm._custom_ops"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def test_the_cost_accounting_file(tmp_path: Path) -> None:
    """SCHEDTOP_COST_FILE (the overhead bench): the recorder's CPU time so far beside its
    process's, one JSON object replaced whole each time, numbered."""
    from recorder.sglang.tap import Tap

    tap = Tap.__new__(Tap)  # write_cost reads only the accounting, not SGLang's scheduler
    tap.cost_seq, tap.next_step, tap.cpu_ns = 0, 12, 3_000
    path = tmp_path / "cost.json"
    tap.write_cost(path)
    tap.next_step = 20
    tap.write_cost(path)
    cost = json.loads(path.read_text())
    assert cost["seq"] == 2 and cost["steps"] == 20 and cost["hooks_ns"] == 3_000
    assert cost["timer_ns"] >= 0  # flush timer threads of this process, if any
    assert cost["process_ns"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["cost.json"]


def test_evicted_slots_round_trip_and_older_readers_skip_them() -> None:
    """1.8: a step's radix-cache evictions, a count of slots; absent, it is 0 and costs no
    bytes, and a reader that does not know key 29 skips it."""
    assert FORMAT_MINOR >= 8
    step = Step(step=4, free_blocks=1024, free_slots=300, cached_slots=500, evicted_slots=64)
    assert decode(RecordType.STEP, encode(step)[1], 0) == step
    body = msgpack.unpackb(encode(step)[1], strict_map_key=False)
    assert body[29] == 64
    del body[29]
    assert decode(RecordType.STEP, msgpack.packb(body), 0).evicted_slots == 0
    plain = msgpack.unpackb(encode(STEP)[1], strict_map_key=False)
    assert 29 not in plain


def test_evicted_slots_are_an_event_in_the_log() -> None:
    from tui.history import step_events

    step = Step(step=4, free_blocks=1024, evicted_slots=64)
    events = list(step_events(step, lambda ref: f"#{ref}"))
    assert [(e.kind, e.text) for e in events] == [("evict", "64 cached slots evicted")]
    assert not list(step_events(Step(step=5, free_blocks=1024), lambda ref: f"#{ref}"))
