"""`--group-by prio|REGEX` (issue 27 item 3): per-group figures from engine.metrics' fold,
whose counts and summed waits add up to the totals, in stats, resim, diff and whatif."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from engine.records import percentile
from replays.groups import OTHER, GroupByError, parse_group_by
from replays.stats import trace_stats
from tests.tui_support import queueing_trace, queueing_workload
from tui.cli import main


@pytest.fixture(scope="module")
def prio_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The head-of-line incident under the priority policy: priorities 0, 1 and 5."""
    d = tmp_path_factory.mktemp("prio")
    return queueing_trace(d, "priority")


def test_stats_group_by_prio_prints_figures_that_sum_to_the_totals(prio_trace: Path) -> None:
    res = CliRunner().invoke(main, ["stats", str(prio_trace), "--group-by", "prio"])
    assert res.exit_code == 0, res.output
    table = res.output[res.output.index("by priority") :].splitlines()
    head = table[1].split()
    assert head[:2] == ["prio", "reqs"] and "TTFT" in head and "queue" in head
    rows = {line.split()[0]: line.split() for line in table[3:] if line[:1].isalnum()}
    assert set(rows) == {"0", "1", "5", "all"}
    assert head[2:5] == ["done", "tokens", "pre"]
    col = {name: i for i, name in enumerate(["key", "reqs", "done", "tokens", "pre"])}
    for c in ("reqs", "done", "tokens", "pre"):
        parts = sum(int(rows[k][col[c]]) for k in ("0", "1", "5"))
        assert parts == int(rows["all"][col[c]]), c
    waits = [float(rows[k][-1]) for k in ("0", "1", "5")]
    assert sum(waits) == pytest.approx(float(rows["all"][-1]))
    # the priority-5 prompt waited at the head: its TTFT is the run's worst
    ttft_5 = rows["5"][5].split("/")
    assert float(ttft_5[0]) > 30 and float(rows["0"][5].split("/")[1]) < float(ttft_5[1])


def test_group_figures_are_the_folds_own(prio_trace: Path) -> None:
    """Each group's percentiles are run_metrics' over its requests (the one truth): the
    same as the percentile of the per-request figures stats reports."""
    s = trace_stats(prio_trace, parse_group_by("prio"))
    assert s.groups is not None
    prio = {
        r.request_id: w["priority"] for r, w in zip(s.requests, queueing_workload()["requests"])
    }
    for g in s.groups:
        mine = [r for r in s.requests if str(prio[r.request_id]) == g.key]
        ttft = [r.ttft for r in mine if r.ttft is not None]
        queue = [r.queue for r in mine if r.queue is not None]
        assert g.metrics.num_requests == len(mine)
        assert g.metrics.ttft_p99 == percentile(ttft, 99)
        assert g.metrics.queue_p50 == percentile(queue, 50)
        assert g.queue_total == pytest.approx(sum(queue))
    assert sum(g.metrics.throughput for g in s.groups) == pytest.approx(s.throughput)
    out = s.to_json()
    assert out["group_by"] == "prio" and [g["group"] for g in out["groups"]] == ["0", "1", "5"]
    json.dumps(out)  # plain JSON


def test_regex_groups_by_its_first_group_or_the_whole_match(prio_trace: Path) -> None:
    s = trace_stats(prio_trace, parse_group_by(r"chatcmpl-000([0-3])"))
    assert s.groups is not None
    keys = {g.key: g.metrics.num_requests for g in s.groups}
    assert keys == {"0": 1, "1": 1, "2": 1, "3": 1, OTHER: 6}
    whole = trace_stats(prio_trace, parse_group_by(r"^chatcmpl-000[0-2]"))
    assert whole.groups is not None
    assert {g.key for g in whole.groups} == {
        "chatcmpl-0000",
        "chatcmpl-0001",
        "chatcmpl-0002",
        OTHER,
    }


def test_tenant_groups_by_the_workloads_field_recorded_with_each_arrival(
    tmp_path: Path,
) -> None:
    w = queueing_workload("priority")
    for i, r in enumerate(w["requests"]):
        if i < 3:
            r["tenant"] = "batch"
        elif i < 8:
            r["tenant"] = "chat"
    workload = tmp_path / "tenants.json"
    workload.write_text(json.dumps(w))
    trace = tmp_path / "tenants.trace"
    subprocess.run(
        [sys.executable, "-m", "tui.cli", "sim", str(workload), "--trace", str(trace)],
        check=True,
        capture_output=True,
    )
    s = trace_stats(trace, parse_group_by("tenant"))
    assert s.groups is not None
    assert [(g.key, g.metrics.num_requests) for g in s.groups] == [
        ("batch", 3),
        ("chat", 5),
        ("(none)", 2),
    ]
    res = CliRunner().invoke(main, ["stats", str(trace), "--group-by", "tenant"])
    assert res.exit_code == 0, res.output
    assert "by tenant" in res.output and "\nbatch " in res.output
    # the tenant is an input like the prompt: re-simulation reproduces every arrival
    again = CliRunner().invoke(main, ["resim", str(trace)])
    assert again.exit_code == 0, again.output
    bad = dict(w, requests=[{**w["requests"][0], "tenant": 7}])
    workload.write_text(json.dumps(bad))
    refused = CliRunner().invoke(main, ["sim", str(workload), "--no-trace"])
    assert refused.exit_code == 2 and "tenant: expected a string" in refused.output


def test_a_bad_group_by_is_one_line(prio_trace: Path) -> None:
    with pytest.raises(GroupByError):
        parse_group_by("(")
    res = CliRunner().invoke(main, ["stats", str(prio_trace), "--group-by", "("])
    assert res.exit_code == 2
    assert res.output.count("\n") == 1 and "not a regular expression" in res.output


def test_resim_diff_and_whatif_compare_each_group(prio_trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "fcfs.trace"
    res = CliRunner().invoke(
        main,
        [
            "resim",
            str(prio_trace),
            "--set",
            "policy=fcfs",
            "--trace",
            str(out),
            "--group-by",
            "prio",
        ],
    )
    assert res.exit_code == 0, res.output
    table = res.output[res.output.index("by priority") :].splitlines()
    assert table[1].split() == ["prio", "reqs", "figure", "A", "B", "change"]
    firsts = [line.split()[:4] for line in table[3:] if line[:1].isdigit()]
    assert firsts == [[p, n, "TTFT", "p99"] for p, n in (("0", "6"), ("1", "3"), ("5", "1"))]
    assert max(len(line) for line in table) <= 80

    d = CliRunner().invoke(
        main, ["diff", str(prio_trace), str(out), "--group-by", "prio", "--json"]
    )
    assert d.exit_code == 1, d.output  # the decisions differ
    got = json.loads(d.output)
    a, b = got["stats_a"]["groups"], got["stats_b"]["groups"]
    assert [g["group"] for g in a] == [g["group"] for g in b] == ["0", "1", "5"]
    # fcfs makes the priority-0 chats wait behind the big prompt
    assert b[0]["queue_total"] > a[0]["queue_total"]

    w = CliRunner().invoke(
        main,
        [
            "whatif",
            str(prio_trace),
            "--model",
            "intercept=0.01,prefill_tokens=0.0001",
            "--set",
            "policy=fcfs",
            "--group-by",
            "prio",
            "--json",
        ],
    )
    assert w.exit_code == 0, w.output
    got = json.loads(w.output)
    rec, pred = got["recorded_groups"], got["predicted_groups"]
    assert [g["group"] for g in rec] == [g["group"] for g in pred] == ["0", "1", "5"]
    assert sum(g["num_requests"] for g in pred) == got["predicted"]["num_requests"]
    assert pred[0]["queue_p99"] > rec[0]["queue_p99"]
