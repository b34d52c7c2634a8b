"""Waits in the incidents view (issue 27, item 1): the longest-queued requests with the
reason of most of their steps and the knob behind it, head-of-line blocking named, and
priority inversion flagged; in tmux at 80x24 and 120x40 on a head-of-line trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recorder.schema import REASON_KNOBS, Reason
from replays.queueing import QueueScan
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.test_tui_terminal import Tmux, tmux  # noqa: F401 -- the fixture
from tests.tui_support import queueing_trace, queueing_workload
from tui.format import short_id


@pytest.fixture(scope="module")
def hol_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("hol")
    return queueing_trace(d)


def longest(trace: Path) -> tuple[str, int]:
    """The request that queued longest before its first admission, from the replayed
    state (not from the scan under test)."""
    tl = Timeline(open_reader(trace))
    end = tl.state(tl.last_step)
    seen: dict[str, int] = {}
    for i in range(tl.first_step, tl.last_step + 1):
        for r in tl.state(i).requests.values():
            if r.first_scheduled_step >= 0:
                seen[r.request_id] = r.first_scheduled_step - r.arrival_step
    assert not end.requests, "every request finished"
    rid = max(seen, key=lambda k: seen[k])
    return rid, seen[rid]


def test_every_reason_names_its_knobs() -> None:
    assert set(REASON_KNOBS) == set(Reason)
    assert REASON_KNOBS[Reason.FULL_PROMPT] == ("scheduler_reserve_full_isl",)
    assert "num_blocks" in REASON_KNOBS[Reason.KV_BLOCKS]


def test_the_scan_names_the_head_of_line_blocking(hol_trace: Path) -> None:
    rid, steps = longest(hol_trace)
    scan = QueueScan(open_reader(hol_trace))
    while scan.advance(7):  # in slices, as the app runs it
        pass
    first = scan.waits()[0]
    assert (first.request_id, first.steps) == (rid, steps)
    assert first.reason == "no free KV blocks" and "num_blocks" in first.knob
    behind = scan.waits()[1]
    assert behind.reason == "behind the queue head" and behind.held_by == rid
    assert behind.inverted  # priority 0 waited while priority 1 ran
    (hol,) = scan.head_of_line()
    assert hol.request_id == rid and len(hol.held) == 6 and hol.steps == steps


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_waits_first_row_in_a_real_terminal(
    tmux: Tmux,  # noqa: F811 -- the fixture
    hol_trace: Path,
    size: tuple[int, int],
) -> None:
    rid, steps = longest(hol_trace)
    tmux.start(f"replay {hol_trace}", *size)
    tmux.wait_for(lambda s: "step 0 /" in s, "step 0")
    tmux("send-keys", "-t", "app", "i")
    screen = tmux.wait_for(lambda s: "waits before admission" in s, "the waits section")
    lines = screen.splitlines()
    at = next(i for i, line in enumerate(lines) if "waits before admission" in line)
    first = lines[at + 1]
    assert short_id(rid) in first and str(steps) in first.split()[0]
    assert "no free KV blocks" in first and "num_blocks" in first
    assert any("head-of-line" in line and short_id(rid) in line for line in lines)
    assert "priority inversion" in lines[at + 2]
    tmux("send-keys", "-t", "app", "q")
    tmux.wait_for(lambda s: "waits before" not in s, "the app gone", may_end=True)


def test_find_names_the_request_behind_a_wait_hit(hol_trace: Path) -> None:
    from click.testing import CliRunner

    from tui.cli import main

    rid, _ = longest(hol_trace)
    bare = CliRunner().invoke(main, ["find", str(hol_trace), "wait>20"])
    named = CliRunner().invoke(main, ["find", str(hol_trace), "wait>20", "--names"])
    assert bare.exit_code == named.exit_code == 0
    step = bare.output.strip()
    assert named.output.split() == [step, rid]  # the big prompt at the head, waiting


def test_sim_lists_every_request_with_all_and_whole_ids(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tui.cli import main

    w = queueing_workload()
    base = w["requests"][-1]
    w["requests"] += [{**base, "id": f"{base['id']}-{i}"} for i in range(40)]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(w))
    short = CliRunner().invoke(main, ["sim", str(path), "--no-trace"])
    every = CliRunner().invoke(main, ["sim", str(path), "--no-trace", "--all"])
    assert short.exit_code == every.exit_code == 0
    assert "... 10 more (--all lists every request)" in short.output
    assert all(r["id"] in every.output for r in w["requests"])  # whole, not cut at 12


def test_waits_are_grouped_by_tenant_where_arrivals_recorded_one(tmp_path: Path) -> None:
    from replays.queueing import QueueScan
    from tests.tui_support import queueing_workload as workload

    w = workload()
    for i, r in enumerate(w["requests"]):
        r["tenant"] = "batch" if i < 4 else "chat"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(w))
    trace = tmp_path / "t.trace"
    subprocess.run(
        [sys.executable, "-m", "tui.cli", "sim", str(path), "--trace", str(trace)],
        check=True,
        capture_output=True,
    )
    scan = QueueScan(open_reader(trace))
    scan.advance()
    waits = scan.waits()
    assert waits[0].tenant == "batch"  # the big prompt at the head
    assert {q.tenant for q in waits[1:]} == {"chat"}

    from tui.incidents import IncidentsVM
    from tui.widgets.waits import _tenants

    vm = IncidentsVM((), None, 0, 0, True, "", waits=waits)  # type: ignore[arg-type]
    (line,) = _tenants(vm)
    longest = max(q.steps for q in waits[1:])
    chats = f"chat: {len(waits) - 1}, longest {longest}"
    assert line.plain == f"by tenant · {chats} · batch: 1, longest {waits[0].steps}"
