"""`schedtop run` records what the real engine did: every decision, the sampled tokens and
the runner's timings per step, in a trace that re-simulates to the same decisions.

The fast tests use a tiny random Llama written as a GGUF file; the slow one runs the
default model through preemptions and prefix-cache hits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from engine.model.api import build_engine, run_workload
from engine.model.workload import parse_run_workload
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from recorder.schema import Step
from replays.diff import diff_traces, format_diff
from replays.resim import resimulate
from replays.stats import trace_stats
from tests.model_support import default_model, needs_default_model, write_tiny_gguf
from tui.cli import main

TINY_OPTIONS = [
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "48",
    "--block-size",
    "16",
    "--num-gpu-blocks-override",
    "64",
    "--max-model-len",
    "256",
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture()
def workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.json"
    path.write_text(
        json.dumps(
            {
                "requests": [
                    {
                        "id": f"r{i}",
                        "prompt": f"request number {i} " * (1 + i),
                        "arrival_time": 0.005 * i,
                        "sampling": {
                            "max_tokens": 6,
                            "temperature": 0.9,
                            "seed": i,
                            "ignore_eos": True,
                        },
                    }
                    for i in range(6)
                ]
            }
        )
    )
    return path


def schedtop_run(gguf: Path, workload: Path, *extra: str) -> Result:
    result = CliRunner().invoke(
        main, ["run", "--model", str(gguf), "--workload", str(workload), *TINY_OPTIONS, *extra]
    )
    assert result.exit_code == 0, result.output
    return result


def steps(path: Path) -> list[Step]:
    with TraceReader(path) as reader:
        assert reader.closed_cleanly
        return list(reader.steps())


def test_run_records_every_step_with_the_runners_timings(
    tiny_gguf: Path, workload_file: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.trace"
    result = schedtop_run(tiny_gguf, workload_file, "--trace", str(path))
    assert f"trace: {path}" in result.stdout
    recorded = steps(path)
    assert recorded and all(s.timings for s in recorded)  # CPU: the host clock, same step
    for s in recorded:
        (t,) = s.timings
        assert t.step == s.step
        assert t.prepare_ns > 0 and t.forward_ns > 0 and t.sample_ns > 0
        assert t.attention_ns is not None and 0 < t.attention_ns < t.forward_ns
        assert s.schedule_ns > 0 and not t.kernels
    with TraceReader(path) as reader:
        assert reader.header.model == "tiny-llama"
        assert "ModelRunner" in reader.header.engine
    sampled = sum(len(s.sampled_tokens or ()) for s in recorded)
    assert sampled == 6 * 6  # every token the engine sampled, none twice
    assert resimulate(path).reproduced


def test_profile_every_puts_a_kernel_breakdown_in_the_trace(
    tiny_gguf: Path, workload_file: Path, tmp_path: Path
) -> None:
    path = tmp_path / "run.trace"
    schedtop_run(tiny_gguf, workload_file, "--trace", str(path), "--profile-every", "3")
    profiled = [s for s in steps(path) if s.timings[0].kernels]
    assert profiled and all(s.step % 3 == 0 for s in profiled)
    kernels = profiled[0].timings[0].kernels
    assert all(k.calls > 0 and k.total_ns >= 0 for k in kernels)
    assert any("mm" in k.name or "linear" in k.name for k in kernels), kernels


def test_run_records_into_the_trace_directory_unless_told_not_to(
    tiny_gguf: Path, workload_file: Path, trace_dir: Path
) -> None:
    schedtop_run(tiny_gguf, workload_file, "--no-trace")
    assert not trace_dir.exists() or not any(trace_dir.iterdir())
    result = schedtop_run(tiny_gguf, workload_file, "--redact-prompts")
    (path,) = trace_dir.glob("*-run-*.trace")
    assert f"trace: {path}" in result.stdout
    with TraceReader(path) as reader:
        assert reader.header.redacted
        assert all(a.prompt_token_ids is None for s in reader.steps() for a in s.arrivals)
    assert all(s.sampled_tokens is None for s in steps(path))
    assert resimulate(path).reproduced  # redacted: the scripted re-simulation


def test_trace_and_no_trace_exclude_each_other(
    tiny_gguf: Path, workload_file: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        main,
        [
            "run",
            "--model",
            str(tiny_gguf),
            "--workload",
            str(workload_file),
            "--trace",
            str(tmp_path / "t"),
            "--no-trace",
        ],
    )
    assert result.exit_code == 2 and "exclude each other" in result.stderr
    assert not (tmp_path / "t").exists()


SYSTEM = (
    "You are a patient assistant. Answer in plain words, explain terms the first time "
    "you use them, and keep every answer short and concrete."
)


@pytest.mark.slow
@pytest.mark.model
@needs_default_model
def test_a_real_model_trace_with_preemptions_and_prefix_hits_resimulates(tmp_path: Path) -> None:
    questions = [
        "What is a cloud?",
        "Name three fruits.",
        "Why is the sea salty?",
        "How do birds fly?",
        "What is rain?",
        "Describe a cat.",
    ]
    data: dict[str, Any] = {
        "config": {
            "max_num_seqs": 6,
            "max_num_batched_tokens": 128,
            "block_size": 16,
            "num_gpu_blocks_override": 24,
            "enable_prefix_caching": True,
        },
        "requests": [
            {
                "id": f"q{i}",
                "arrival_time": 0.0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "sampling": {"max_tokens": 40, "temperature": 0.8, "seed": i, "ignore_eos": True},
            }
            for i, q in enumerate(questions)
        ],
    }
    w = parse_run_workload(data, "test")
    engine = build_engine(w, loaded=default_model())
    path = tmp_path / "real.trace"
    summary = run_workload(
        w, engine=engine, on_engine=lambda e: open_recording(e.core, path, kind="run")
    )
    assert summary.num_finished == 6 and summary.num_preemptions >= 1
    assert summary.cached_tokens > 0

    stats = trace_stats(path)
    assert stats.preemptions == summary.num_preemptions
    assert stats.prefix_hit_rate > 0 and stats.output_tokens == 6 * 40
    recorded = steps(path)
    assert all(
        s.timings and s.timings[0].forward_ns > 0 and s.timings[0].sample_ns > 0 for s in recorded
    )
    result = resimulate(path)
    assert result.mode == "faithful" and result.reproduced, result.divergence
    assert result.num_steps == len(recorded)

    what_if = resimulate(path, {"max_num_batched_tokens": 64}, tmp_path / "64.trace")
    assert what_if.divergence is not None
    d = diff_traces(path, tmp_path / "64.trace")
    assert d.first_step == what_if.divergence.step
    assert f"first difference at step {d.first_step}" in format_diff(d)
