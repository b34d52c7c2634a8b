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


def test_sim_runs_a_workload_in_runs_format(tmp_path: Path) -> None:
    """One workload file serves `run` and `sim`: text and chat prompts are tokenized with
    the default tokenizer, arrival times become steps, `sampling.max_tokens` the length."""
    from engine.model.workload import parse_run_workload
    from engine.sim.run_format import STEPS_PER_S, default_tokenizer
    from recorder.reader import TraceReader

    data = {
        "description": "one file for run and sim",
        "config": {"max_num_seqs": 4, "num_gpu_blocks_override": 40, "kv_cache_memory": "1GiB"},
        "requests": [
            {"id": "chat", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
            {"id": "text", "prompt": "Once upon a time", "arrival_time": 0.4,
             "sampling": {"max_tokens": 5, "temperature": 0.8}},
            {"id": "ids", "prompt_token_ids": [1, 9690, 198], "sampling": {"max_tokens": 3}},
        ],
    }  # fmt: skip
    parse_run_workload(data)  # `run` takes it as it is
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    trace = tmp_path / "w.trace"
    out = schedtop("sim", str(path), "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    tok = default_tokenizer()
    want = {
        "chat": (0, len(tok.apply_chat_template(data["requests"][0]["messages"]))),
        "text": (round(0.4 * STEPS_PER_S), len(tok.encode("Once upon a time"))),
        "ids": (0, 3),
    }
    with TraceReader(trace) as reader:
        assert reader.header.num_blocks == 40
        got = {
            a.request_id: (step.step, a.num_prompt_tokens)
            for step in reader.steps()
            for a in step.arrivals
        }
    assert got == want
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line}
    assert lines["text"][-1] == "length" and lines["ids"][-1] == "length"


def test_sim_refuses_a_bad_run_format_workload(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"requests": [{"id": "a", "prompt": "hi", "colour": "red"}]}))
    out = schedtop("sim", str(path))
    assert out.returncode == 2 and "unknown field 'colour'" in out.stderr
    assert "Traceback" not in out.stderr


RUN_FORMAT = {
    "config": {"max_num_seqs": 4, "num_gpu_blocks_override": 40, "scheduling_policy": "priority"},
    "requests": [
        {"id": "chat", "messages": [{"role": "user", "content": "Why is the sky blue?"}]},
        {"id": "text", "prompt": "Once upon a time", "sampling": {"max_tokens": 2}},
    ],
}


def test_sim_on_a_run_workload_imports_neither_torch_nor_numpy(tmp_path: Path) -> None:
    """The scheduling path is pure Python: tokenizing a run workload's prompts reads the
    default model's GGUF metadata without torch, numpy or the `gguf` package."""
    path = tmp_path / "w.json"
    path.write_text(json.dumps(RUN_FORMAT))
    code = (
        "import sys\n"
        "from tui.cli import main\n"
        f"sys.argv = ['schedtop', 'sim', {str(path)!r}, '--no-trace']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('torch', 'numpy', 'gguf') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "finished 2, errors 0" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # `run` loads the default model
def test_one_workload_file_records_the_same_config_under_sim_and_run(tmp_path: Path) -> None:
    """One default per knob, one builder: `sim` and `run` of the same file record the
    same engine config (the pool too, given num_gpu_blocks_override)."""
    from recorder.reader import TraceReader

    path = tmp_path / "w.json"
    path.write_text(json.dumps(RUN_FORMAT))
    configs = []
    for command in (["sim", str(path)], ["run", "--workload", str(path)]):
        trace = tmp_path / f"{command[0]}.trace"
        out = schedtop(*command, "--trace", str(trace))
        assert out.returncode == 0, out.stderr
        with TraceReader(trace) as reader:
            configs.append((reader.header.config, reader.header.num_blocks))
    assert configs[0] == configs[1]
    config, blocks = configs[0]
    assert blocks == 40 and config["max_num_seqs"] == 4 and config["policy"] == "priority"
    assert config["max_num_batched_tokens"] == 2048  # EngineConfig's default, in both
