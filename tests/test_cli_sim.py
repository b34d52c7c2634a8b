"""`schedtop sim` as a user runs it: real processes, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).parent / "data" / "fidelity"


def schedtop(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True, cwd=cwd
    )


def test_demo_runs_and_prints_a_summary() -> None:
    out = schedtop("sim")
    assert out.returncode == 0, out.stderr
    assert "steps" in out.stdout and "preemptions" in out.stdout
    assert "req-00" in out.stdout


def test_decisions_file_matches_the_fidelity_case(tmp_path: Path) -> None:
    dest = tmp_path / "d.jsonl"
    case = CASES / "c_kv_pressure_prefix"
    out = schedtop("sim", f"{case}.workload.json", "--decisions", str(dest))
    assert out.returncode == 0, out.stderr
    got = [json.loads(x) for x in dest.read_text().splitlines()]
    want = [json.loads(x) for x in Path(f"{case}.decisions.jsonl").read_text().splitlines()]
    assert [g["scheduled"] for g in got] == [w["scheduled"] for w in want]
    assert [g["preempted"] for g in got] == [w["preempted"] for w in want]


def test_set_overrides_a_config_key(tmp_path: Path) -> None:
    dest = tmp_path / "d.jsonl"
    case = CASES / "b_four_1000_prompts.workload.json"
    out = schedtop(
        "sim", str(case), "--set", "max_num_batched_tokens=4096", "--decisions", str(dest)
    )
    assert out.returncode == 0, out.stderr
    first = json.loads(dest.read_text().splitlines()[0])
    assert first["scheduled"] == {"R0": 1000, "R1": 1000, "R2": 1000, "R3": 1000}


def _bad(tmp_path: Path, content: str) -> Path:
    p = tmp_path / "w.json"
    p.write_text(content)
    return p


@pytest.mark.parametrize(
    ("make", "args", "needle"),
    [
        (lambda t: t / "missing.json", (), "no such file"),
        (lambda t: _bad(t, "{not json"), (), "not valid JSON"),
        (
            lambda t: _bad(t, '{"config": {"bogus_key": 1}, "requests": []}'),
            (),
            "unknown config key 'bogus_key'",
        ),
        (
            lambda t: _bad(t, '{"config": {"max_num_seqs": 0}, "requests": []}'),
            (),
            "max_num_seqs=0",
        ),
        (
            lambda t: _bad(
                t, '{"config": {"max_num_seqs": 64, "max_num_batched_tokens": 32}, "requests": []}'
            ),
            (),
            "max_num_batched_tokens=32",
        ),
        (
            lambda t: _bad(
                t,
                '{"requests": [{"id": "a", "prompt_token_ids": [1], "max_tokens": 1},'
                ' {"id": "a", "prompt_token_ids": [2], "max_tokens": 1}]}',
            ),
            (),
            "duplicate request id 'a'",
        ),
        (
            lambda t: _bad(t, '{"requests": [{"id": "a", "prompt_token_ids": "hi"}]}'),
            (),
            "prompt_token_ids",
        ),
        (
            lambda t: CASES / "a_decode_plus_arrival.workload.json",
            ("--set", "policy=lifo"),
            "policy='lifo'",
        ),
        (
            lambda t: CASES / "a_decode_plus_arrival.workload.json",
            ("--set", "nope=1"),
            "unknown config key 'nope'",
        ),
        (
            lambda t: CASES / "a_decode_plus_arrival.workload.json",
            ("--set", "block_size=x"),
            "block_size='x': expected int",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, make, args, needle) -> None:  # type: ignore[no-untyped-def]
    out = schedtop("sim", str(make(tmp_path)), *args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_failed_run_leaves_no_half_written_decisions(tmp_path: Path) -> None:
    w = _bad(
        tmp_path,
        json.dumps(
            {
                "config": {"max_steps": 3},
                "requests": [{"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 50}],
            }
        ),
    )
    dest = tmp_path / "out.jsonl"
    out = schedtop("sim", str(w), "--decisions", str(dest))
    assert out.returncode == 2 and "max_steps=3" in out.stderr
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == [w]
