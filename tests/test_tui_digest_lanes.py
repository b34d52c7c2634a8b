"""Issue 28 item 3: the shortcuts a live view takes for the steps a busy engine writes
most (decodes only) and for a batch of records (decoded back to back before they are
applied) must give what the general paths give, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest

from recorder.errors import TraceError
from recorder.framing import FRAME_SIZE
from recorder.multi import open_trace
from recorder.schema import RecordType
from replays.timeline import Timeline
from tests.helpers import open_reader
from tui import history
from tui.waits import decoders

ROOT = Path(__file__).resolve().parent.parent
TRACES = sorted((ROOT / "replays" / "incidents").glob("*.trace")) + sorted(
    (ROOT / "tests" / "data").glob("*.trace")
)


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_the_decodes_only_digest_is_the_general_one(path: Path) -> None:
    with Timeline(open_trace(path)) as tl:
        _check_lane(tl)


def _check_lane(tl: Timeline) -> None:
    known: dict[int, str] = {}  # whose cached blocks: filled as History fills it
    lane = 0
    for s in range(max(tl.first_step, 1), tl.last_step + 1):
        before = tl.state(s - 1)
        rec = tl.record(s)
        evictions = history._evictions(rec)
        names = history.names_before(rec, before, evictions)
        leading = decoders(rec, before)
        after = tl.state(s)
        for engine_time in (False, True):
            for prev in (None, rec.time_ns - 5, rec.time_ns + 5):
                args = (rec, names, after, prev, engine_time, leading, True, known, evictions)
                assert history.digest(*args) == history.digest_any(*args), s
        lane += not (rec.arrivals or rec.admissions or rec.finishes or rec.scheduled)
        for ref, blocks in history._cached(rec.kv_events):
            r = after.requests.get(ref)
            if r is not None:
                known.update(dict.fromkeys(blocks, r.request_id))
    assert lane > 0  # the lane was taken


def test_a_batch_read_ahead_gives_the_records_one_by_one_reads_give(tmp_path: Path) -> None:
    path = TRACES[0]
    with (
        Timeline(open_reader(path)) as one,
        Timeline(open_reader(path), max_cached_records=64) as ahead,
    ):
        ahead.read_ahead(ahead.first_step, ahead.last_step)  # clamped to half the cache
        assert len(ahead._records) == 32
        for s in range(one.first_step, one.last_step + 1):
            ahead.read_ahead(s, s + 40)
            assert ahead.record(s) == one.record(s)
            assert len(ahead._records) <= 64


def test_a_read_ahead_stops_at_a_bad_record_and_the_walk_raises_there(tmp_path: Path) -> None:
    src = TRACES[0]
    with Timeline(open_reader(src)) as tl:
        bad_step = tl.first_step + 10
        at = tl.offset(bad_step)
    data = bytearray(src.read_bytes())
    data[at + 20] ^= 0xFF  # inside the record's body: its checksum fails
    copy = tmp_path / "bad.trace"
    copy.write_bytes(bytes(data))
    with Timeline(open_reader(copy)) as tl:
        tl.read_ahead(tl.first_step, tl.first_step + 30)
        assert set(tl._records) == set(range(tl.first_step, bad_step))
        h = history.History()
        with pytest.raises(TraceError, match="checksum"):
            h.fill(tl, tl.first_step, tl.first_step + 30)
        assert h.get(bad_step - 1) is not None and h.get(bad_step) is None


def test_records_of_passes_over_other_records_and_stops_where_a_record_is_cut(
    tmp_path: Path,
) -> None:
    src = TRACES[0]
    data = src.read_bytes()
    with open_reader(src) as whole:
        starts = [offset for offset, _, _ in whole.frames()]
        found, end = whole.records_of(RecordType.STEP)
        assert [e.offset for e in found] == list(whole.index().step_offsets)
        assert whole.finished
    cut_at = starts[len(starts) // 2]
    for cut in (cut_at + 3, cut_at + FRAME_SIZE + 2):  # in its frame header, in its body
        part = tmp_path / f"part-{cut}.trace"
        part.write_bytes(data[:cut])
        with open_reader(part) as reader:
            found, end = reader.records_of(RecordType.CLIENT, tail=True)
            assert (found, end) == ([], cut_at)
            assert reader.cut is None and not reader.finished
            found, end = reader.records_of(RecordType.CLIENT, start=end, tail=True)
            assert (found, end) == ([], cut_at)
