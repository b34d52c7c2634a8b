"""Issue 14, class 7: nothing printed from a trace or a workload reaches the terminal raw.
Escape sequences in request ids, descriptions, host and model names come out as visible
`\\x1b` text. Real files and real processes (stdout is a pipe, as in a terminal log)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from tests.test_hostile_traces import build
from tests.test_trace_fuzz import valid_records

EVIL = "\x1b]0;pwned\x07\x1b[2J\x9b\u202e"


def schedtop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tui.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def clean(text: str) -> None:
    assert not any(c in text for c in "\x1b\x07\x9b\u202e"), repr(text)
    assert "\\x1b" in text


def test_sim_summary_and_trace_readers_show_escapes_as_text(tmp_path: Path) -> None:
    workload = tmp_path / "w.json"
    req = {"prompt_token_ids": [1, 2, 3], "output_token_ids": [4, 5], "max_tokens": 2}
    workload.write_text(
        json.dumps(
            {
                "description": f"desc {EVIL}",
                "config": {"max_model_len": 64},
                "requests": [
                    {"id": f"a{EVIL}", **req},
                    {"id": f"b{EVIL}", "arrival_step": 1, **req, "prompt_token_ids": [1] * 70},
                ],
            }
        )
    )
    trace = tmp_path / "t.trace"
    sim = schedtop("sim", str(workload), "--trace", str(trace))
    assert sim.returncode == 0, sim.stderr
    clean(sim.stdout)
    assert "error: prompt of 70 tokens" in sim.stdout  # the message of a refused request
    other = tmp_path / "o.trace"
    workload2 = tmp_path / "w2.json"
    data = json.loads(workload.read_text())
    data["config"].update(max_num_seqs=1, max_num_batched_tokens=2)
    workload2.write_text(json.dumps(data))
    assert schedtop("sim", str(workload2), "--trace", str(other)).returncode == 0
    diff = schedtop("diff", str(trace), str(other))
    assert diff.returncode == 1 and "\x1b" not in diff.stdout
    for cmd in ("info", "stats"):
        out = schedtop(cmd, str(trace))
        assert out.returncode == 0 and "\x1b" not in out.stdout


def test_info_shows_a_hostile_header_as_text(tmp_path: Path) -> None:
    header, *records = valid_records()
    evil = dataclasses.replace(header, host=f"host{EVIL}", model=f"model{EVIL}")
    path = tmp_path / "t.trace"
    path.write_bytes(build([evil, *records]))
    out = schedtop("info", str(path))
    assert out.returncode == 0, out.stderr
    clean(out.stdout)
    assert "host\\x1b]0;pwned\\x07" in out.stdout and "model\\x1b" in out.stdout
