"""The reader: iteration, the index with and without a footer, seeking, cut tails, tail
mode, and clear errors for files that are not traces."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from engine.sim.api import demo_workload_path
from engine.sim.workload import load_workload
from recorder.codec import encode
from recorder.errors import TraceError
from recorder.framing import END_RECORD_SIZE, FRAME_SIZE, PREAMBLE_SIZE, frame, preamble
from recorder.reader import TraceReader
from recorder.schema import End, Footer, Header, Snapshot, Step
from tests.helpers import record, write_trace


@pytest.fixture(scope="module")
def demo() -> tuple[bytes, int]:
    """The demo workload's trace (snapshots every 16 steps) and its number of steps."""
    run = record(load_workload(demo_workload_path()), snapshot_interval=16)
    return run.data, len(run.states)


def test_a_clean_trace_reads_back_whole(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, num_steps = demo
    with TraceReader(write_trace(tmp_path, data)) as reader:
        records = [e.record for e in reader.entries()]
        assert reader.closed_cleanly and reader.cut is None and reader.finished
    kinds = [type(r).__name__ for r in records]
    assert kinds.count("Step") == num_steps
    assert kinds.count("Snapshot") == num_steps // 16
    assert kinds[-2:] == ["Footer", "End"]
    steps = [r.step for r in records if isinstance(r, Step)]
    assert steps == list(range(num_steps))


def test_footer_index_equals_the_scanned_index(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, _ = demo
    path = write_trace(tmp_path, data)
    no_footer = write_trace(tmp_path, _without_footer(path), "cut.trace")
    with TraceReader(path) as a, TraceReader(no_footer) as b:
        assert a.footer is not None and b.footer is None
        ia, ib = a.index(), b.index()
        assert list(ia.step_offsets) == list(ib.step_offsets)
        assert (
            list(ia.snapshot_steps)
            == list(ib.snapshot_steps)
            == [15, 31, 47, 63, 79, 95, 111, 127, 143, 159]
        )
        assert list(ia.snapshot_offsets) == list(ib.snapshot_offsets)
        assert b.cut is None and not b.closed_cleanly


@pytest.mark.parametrize("footer", [True, False])
def test_seek_starts_at_the_nearest_snapshot(
    tmp_path: Path, demo: tuple[bytes, int], footer: bool
) -> None:
    data, num_steps = demo
    path = write_trace(tmp_path, data)
    if not footer:
        path = write_trace(tmp_path, _without_footer(path), "cut.trace")
    with TraceReader(path) as reader:
        for step in [0, 14, 15, 16, 100, num_steps - 1]:
            seek = reader.seek(step)
            start = -1 if seek.snapshot is None else seek.snapshot.step
            assert start == (step + 1) // 16 * 16 - 1
            assert [e.record.step for e in seek.steps] == list(range(start + 1, step + 1))
        with pytest.raises(ValueError, match="not in this trace"):
            reader.seek(num_steps)


def test_a_cut_at_every_byte_keeps_every_whole_record(tmp_path: Path) -> None:
    """Whatever byte the writer died at, the reader returns the records before it and
    names the offset of the incomplete one."""
    case = Path(__file__).parent / "data" / "fidelity" / "c_kv_pressure_prefix.workload.json"
    data = record(load_workload(case), snapshot_interval=8).data
    with TraceReader(write_trace(tmp_path, data)) as whole:
        entries = list(whole.entries())
        header_end = whole.records_start
    starts = [e.offset for e in entries]
    ends = starts[1:] + [len(data)]
    rng = random.Random(4)
    cuts = sorted(set(rng.sample(range(header_end, len(data)), 150) + starts[:20]))
    for cut in cuts:
        with TraceReader(write_trace(tmp_path, data[:cut], "c.trace")) as reader:
            got = [e.record for e in reader.entries()]
            whole_records = [e.record for e, end in zip(entries, ends) if end <= cut]
            assert got == whole_records[: len(got)]
            if cut in starts:
                assert reader.cut is None and len(got) == len(whole_records)
            else:
                assert reader.cut is not None
                assert reader.cut.offset == max(s for s in starts if s < cut)
                assert len(got) == len(whole_records)


def test_a_file_cut_inside_the_header_is_an_incomplete_trace(
    tmp_path: Path, demo: tuple[bytes, int]
) -> None:
    data, _ = demo
    for cut in (0, 5, PREAMBLE_SIZE, PREAMBLE_SIZE + FRAME_SIZE + 3):
        with pytest.raises(TraceError) as info:
            TraceReader(write_trace(tmp_path, data[:cut]))
        assert info.value.incomplete


@pytest.mark.parametrize(
    "content, message",
    [
        (b"hello, this is a text file and not a trace", "wrong magic bytes"),
        (preamble(2, 0) + b"\x00" * 40, "format 2.0 is newer than this schedtop reads"),
        (preamble(0, 3) + b"\x00" * 40, "unknown trace format 0.3"),
        (preamble() + b"\x00" * 40, "invalid record type 0"),
        (preamble() + frame(2, encode(Step(0))[1]), "the first record is not a header"),
        (preamble() + struct.pack("<IBI", 2**31, 1, 0), "exceeds the limit"),
    ],
)
def test_bad_files_raise_a_clear_trace_error(tmp_path: Path, content: bytes, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        TraceReader(write_trace(tmp_path, content))


def test_a_flipped_bit_is_a_checksum_error_at_that_record(
    tmp_path: Path, demo: tuple[bytes, int]
) -> None:
    data, _ = demo
    with TraceReader(write_trace(tmp_path, data)) as reader:
        victim = [e.offset for e in reader.entries()][40]
    broken = bytearray(data)
    broken[victim + FRAME_SIZE + 2] ^= 0x10
    with (
        TraceReader(write_trace(tmp_path, broken, "b.trace")) as reader,
        pytest.raises(TraceError, match="checksum mismatch") as info,
    ):
        list(reader.entries())
    assert info.value.offset == victim


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        TraceReader(tmp_path / "nope.trace")
    with pytest.raises(TraceError, match="not a regular file"):
        TraceReader(tmp_path)


def test_unknown_record_types_are_skipped(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, num_steps = demo
    with TraceReader(write_trace(tmp_path, data)) as reader:
        first_step = reader.index().step_offsets[0]
    data = _without_footer_bytes(data)
    grown = data[:first_step] + frame(42, b"\x81\x00\xa3new") + data[first_step:]
    with TraceReader(write_trace(tmp_path, grown, "g.trace")) as reader:
        steps = list(reader.steps())
    assert len(steps) == num_steps


def test_tail_mode_follows_a_growing_file(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, num_steps = demo
    path = tmp_path / "live.trace"
    with TraceReader(write_trace(tmp_path, data)) as whole:
        header_end = whole.records_start
    path.write_bytes(data[:header_end])
    got: list[object] = []
    with TraceReader(path) as reader:
        at = header_end
        rng = random.Random(1)
        while at < len(data):
            at = min(len(data), at + rng.randint(1, 3000))
            path.write_bytes(data[:at])
            got += [e.record for e in reader.poll()]
            assert reader.cut is None
        assert reader.finished
    assert [type(r).__name__ for r in got].count("Step") == num_steps
    assert isinstance(got[-1], End)


def test_follow_stops_when_idle(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, _ = demo
    path = write_trace(tmp_path, _without_footer_bytes(data))
    with TraceReader(path) as reader:
        entries = list(reader.follow(poll_s=0.001, idle_timeout_s=0.05))
    assert entries and not reader.finished


def test_wait_for_opens_once_the_header_is_there(tmp_path: Path) -> None:
    path = tmp_path / "late.trace"
    with pytest.raises(TraceError, match="no such file"):
        TraceReader.wait_for(path, timeout_s=0.05, poll_s=0.01)
    header = Header("e", "", {}, 16, 64, "fcfs", 0, "h", False)
    path.write_bytes(preamble() + frame(*encode(header)))
    with TraceReader.wait_for(path, timeout_s=1) as reader:
        assert reader.header == header


def test_a_footer_pointing_nowhere_is_an_error(tmp_path: Path, demo: tuple[bytes, int]) -> None:
    data, _ = demo
    bad = data[:-END_RECORD_SIZE] + frame(*encode(End(PREAMBLE_SIZE + 3)))
    with pytest.raises(TraceError, match="footer offset 15 is outside the file"):
        TraceReader(write_trace(tmp_path, bad))
    with TraceReader(write_trace(tmp_path, data)) as reader:
        step_at = reader.index().step_offsets[3]
    bad = data[:-END_RECORD_SIZE] + frame(*encode(End(step_at)))
    with pytest.raises(TraceError, match="does not point at a footer"):
        TraceReader(write_trace(tmp_path, bad))
    footer = Footer(0, (), (1,), (), 0, 0, 0, 0, 0)
    at = len(data) - END_RECORD_SIZE
    bad = data[:-END_RECORD_SIZE] + frame(*encode(footer)) + frame(*encode(End(at)))
    with pytest.raises(TraceError, match="snapshot steps and offsets"):
        TraceReader(write_trace(tmp_path, bad))


def test_snapshot_records_in_a_scan_get_the_step_before_them(
    tmp_path: Path, demo: tuple[bytes, int]
) -> None:
    data, _ = demo
    with TraceReader(write_trace(tmp_path, data)) as reader:
        snaps = [e.record for e in reader.entries() if isinstance(e.record, Snapshot)]
        assert [s.step for s in snaps] == list(reader.index().snapshot_steps)


def _without_footer(path: Path) -> bytes:
    return _without_footer_bytes(path.read_bytes())


def _without_footer_bytes(data: bytes) -> bytes:
    """The trace as a writer killed before close leaves it."""
    end = data[-END_RECORD_SIZE + FRAME_SIZE :]
    footer_offset = int.from_bytes(end[3:], "big")
    return data[:footer_offset]


def test_reading_and_replaying_import_only_the_step_vocabulary() -> None:
    """Replays and the TUI read traces through the recorder's schema, whose records are
    engine.records, and whose limits are engine.limits (the writers' ranges are the
    readers'), whose errors derive from engine.errors' UserError: nothing else of the
    engine, and no torch."""
    import subprocess
    import sys

    code = (
        "import sys, recorder, recorder.reader, recorder.info, replays.reducer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['engine', 'engine.errors', 'engine.limits', 'engine.records']"
