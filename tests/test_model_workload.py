"""The real-engine workload format, `run_workload` and `schedtop run`, on a tiny model
written as a GGUF file (the default model is exercised by the parity tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine.model.api import (
    default_workload_path,
    engine_config,
    format_summary,
    load,
    run_workload,
)
from engine.model.workload import parse_run_workload
from engine.records import percentile
from engine.workload_file import WorkloadError
from tests.model_support import write_tiny_gguf
from tui.cli import main

OUTPUT_KEYS = {
    "id",
    "prompt_token_ids",
    "output_token_ids",
    "text",
    "finish_reason",
    "num_preemptions",
    "num_cached_tokens",
    "ttft_s",
    "tpot_s",
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def workload(requests: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    return {"description": "test", "config": config, "requests": requests}


def test_the_built_in_workload_parses() -> None:
    w = load(None)
    assert w.source == str(default_workload_path()) and len(w.requests) >= 20
    assert [r.arrival_time for r in w.requests] == sorted(r.arrival_time for r in w.requests)
    assert any(r.messages for r in w.requests) and any(r.prompt for r in w.requests)
    assert any(r.sampling.get("seed") is not None for r in w.requests)


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "expected a JSON object"),
        ({"requests": {}}, "'requests' must be a list"),
        ({"config": [], "requests": []}, "'config' must be an object"),
        ({"config": {"warp_speed": 9}, "requests": []}, "unknown option 'warp_speed'"),
        ({"requests": [{"prompt": "x"}]}, "missing 'id'"),
        ({"requests": [{"id": 1, "prompt": "x", "messages": []}]}, "exactly one of"),
        ({"requests": [{"id": 1}]}, "exactly one of"),
        ({"requests": [{"id": 1, "prompt": 5}]}, "'prompt' must be a string"),
        ({"requests": [{"id": 1, "messages": [{"role": "user"}]}]}, "'messages' must be"),
        ({"requests": [{"id": 1, "prompt_token_ids": ["a"]}]}, "list of integers"),
        ({"requests": [{"id": 1, "prompt": "x", "arrival_time": -1}]}, "arrival_time"),
        ({"requests": [{"id": 1, "prompt": "x", "sampling": {"beam": 2}}]}, "unknown key 'beam'"),
        (
            {"requests": [{"id": 1, "prompt": "x", "sampling": {"max_tokens": "9"}}]},
            "sampling.max_tokens='9': expected int",
        ),
        ({"requests": [{"id": 1, "prompt": "x", "sampling": {"ignore_eos": 1}}]}, "expected bool"),
        ({"requests": [{"id": 1, "prompt": "x"}, {"id": 1, "prompt": "y"}]}, "duplicate"),
        ({"requests": [{"id": 1, "prompt": "x", "colour": "red"}]}, "unknown field 'colour'"),
    ],
)
def test_malformed_workloads_are_workload_errors(data: Any, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        parse_run_workload(data, "w.json")


def test_options_merge_defaults_workload_and_command_line() -> None:
    w = parse_run_workload(
        workload([], max_num_seqs=8, scheduling_policy="priority", block_size=32)
    )
    merged = w.merged({"max_num_seqs": 4, "block_size": None})
    config = engine_config(merged, max_position=1024)
    assert (config.max_num_seqs, config.block_size, config.policy) == (4, 32, "priority")
    # one default per knob, the same as `sim`'s (EngineConfig's)
    assert config.max_model_len == 1024 and config.max_num_batched_tokens == 2048
    assert engine_config(parse_run_workload(workload([])).merged(), 1024).max_num_seqs == 256
    bad = parse_run_workload(workload([], max_num_seqs=64, max_num_batched_tokens=8)).merged()
    with pytest.raises(WorkloadError, match="max_num_batched_tokens"):
        engine_config(bad, 1024)


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)


def test_run_workload_serves_good_requests_and_reports_bad_ones(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    greedy = {"max_tokens": 6, "temperature": 0.0}
    w = parse_run_workload(
        workload(
            [
                {"id": "chat", "messages": [{"role": "user", "content": "hi"}], "sampling": greedy},
                {
                    "id": "text",
                    "prompt": "once upon",
                    "arrival_time": 0.05,
                    "sampling": {"max_tokens": 4, "seed": 3},
                },
                {"id": "ids", "prompt_token_ids": [5, 6, 7], "sampling": greedy},
                {"id": "empty", "prompt": "", "sampling": greedy},
                {"id": "zero", "prompt": "x", "sampling": {"max_tokens": 0}},
                {"id": "vocab", "prompt_token_ids": [1, 100000], "sampling": greedy},
                {"id": "long", "prompt": "y" * 300, "sampling": greedy},
            ],
            max_model_len=256,
            max_num_seqs=4,
            num_gpu_blocks_override=64,
        )
    )
    out = tmp_path / "out.jsonl"
    summary = run_workload(w, tiny_gguf, outputs_path=out)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(records) == [r.id for r in w.requests]
    assert all(set(r) >= OUTPUT_KEYS for r in records.values())
    for rid in ("chat", "ids"):
        assert records[rid]["finish_reason"] == "length"
        assert len(records[rid]["output_token_ids"]) == 6 and records[rid]["ttft_s"] >= 0
    for rid, why in [
        ("empty", "empty prompt"),
        ("zero", "max_tokens=0"),
        ("vocab", "not a token id"),
        ("long", "max_model_len=256"),
    ]:
        assert records[rid]["finish_reason"] == "error" and why in records[rid]["error"]
    assert summary.num_finished == 3 and len(summary.errors) == 4
    assert summary.output_tokens == 16 and summary.num_steps > 0
    text = format_summary(summary)
    assert "tok/s" in text and "TTFT p50" in text and "prefix-hit rate" in text


def test_schedtop_run_end_to_end(tiny_gguf: Path, tmp_path: Path) -> None:
    wfile = tmp_path / "w.json"
    wfile.write_text(
        json.dumps(
            workload(
                [
                    {
                        "id": f"r{i}",
                        "prompt": f"request number {i}",
                        "arrival_time": 0.01 * i,
                        "sampling": {"max_tokens": 5, "temperature": 0.0},
                    }
                    for i in range(5)
                ]
            )
        )
    )
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_gguf),
            "--workload",
            str(wfile),
            "--outputs",
            str(out),
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            "64",
            "--block-size",
            "16",
            "--num-gpu-blocks-override",
            "32",
            "--max-model-len",
            "256",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "fcfs",
            "--seed",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "requests 5 (finished 5, errors 0)" in result.stdout
    assert "output tokens 25" in result.stdout and "TPOT p50" in result.stdout
    assert len(out.read_text().splitlines()) == 5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model.gguf"], "no model at /no/such/model.gguf"),
        (["--workload", "/no/such/w.json"], "no such file"),
        (["--max-num-seqs", "0"], "max_num_seqs=0"),
        (["--kv-cache-memory", "lots"], "expected a size"),
        (["--outputs", "/no/such/dir/o.jsonl"], "no directory /no/such/dir"),
    ],
)
def test_schedtop_run_errors_are_one_line_and_exit_2(
    args: list[str], message: str, tiny_gguf: Path
) -> None:
    if "--model" not in args:
        args = [*args, "--model", str(tiny_gguf)]
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_schedtop_run_with_a_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    result = CliRunner().invoke(main, ["run", "--model", str(bad)])
    assert result.exit_code == 2 and "not a valid GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
