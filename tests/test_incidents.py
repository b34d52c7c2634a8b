"""The curated incident traces: today's scheduler reproduces every decision in them, and
each still shows what its README line says."""

from __future__ import annotations

from pathlib import Path

import pytest

from replays.breakpoints import find, find_all, parse
from replays.diff import diff_traces
from replays.resim import resimulate
from replays.stats import trace_stats
from replays.timeline import Timeline
from tests.helpers import open_reader

HERE = Path(__file__).resolve().parent.parent / "replays" / "incidents"
TRACES = sorted(HERE.glob("*.trace"))


def test_every_workload_has_a_trace_and_a_readme_line() -> None:
    names = {p.name.replace(".workload.json", "") for p in HERE.glob("*.workload.json")}
    assert names == {p.stem for p in TRACES} and len(names) >= 4
    readme = (HERE / "README.md").read_text()
    assert all(f"`{n}.trace`" in readme for n in names)


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_resimulation_reproduces_the_incident(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "resim.trace"
    result = resimulate(trace, out=out)
    assert result.reproduced, result.divergence
    assert diff_traces(trace, out).identical


def timeline(name: str) -> Timeline:
    return Timeline(open_reader(HERE / f"{name}.trace"))


def test_preemption_storm() -> None:
    tl = timeline("preemption_storm")
    assert find(tl, [parse("preempt")], -1) == 4
    view = tl.view(4)
    p = view.record.preemptions[0]
    assert (view.names[p.victim], view.names[p.for_request]) == ("s15", "s15")
    assert len(list(find_all(tl, [parse("preempt")]))) == 25


def test_head_of_line_blocking_behind_a_long_prefill() -> None:
    tl = timeline("hol_long_prefill")
    for step in range(3, 8):
        doc = [e for e in tl.view(step).scheduled if tl.view(step).names[e.ref] == "doc"]
        assert doc and doc[0].num_tokens == 509
    assert find(tl, [parse("first-token:late0")], -1) == 8
    assert tl.record(5).waiting_stop is not None


def test_prefix_thrash_and_its_fix(tmp_path: Path) -> None:
    thrash = trace_stats(HERE / "prefix_thrash.trace")
    out = tmp_path / "bigger.trace"
    resimulate(HERE / "prefix_thrash.trace", {"num_blocks": 60}, out)
    assert round(thrash.prefix_hit_rate, 3) == 0.086
    assert trace_stats(out).prefix_hit_rate > 3 * thrash.prefix_hit_rate


def test_watermark_prevents_the_oscillation() -> None:
    off = timeline("watermark_off")
    assert [s for s in find_all(off, [parse("preempt:w04")])] == [34, 41]
    assert find(off, [parse("admit:w04")], 34) == 40
    assert trace_stats(HERE / "watermark_off.trace").preemptions == 10
    assert trace_stats(HERE / "watermark_on.trace").preemptions == 2
