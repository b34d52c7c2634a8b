"""bench/gpu_check.py judges what a lent GPU reports; no GPU is here, so its judgments are
checked on outputs shaped like the real ones, and its kernel step runs for real on CPU
(the Triton kernel interpreted)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def load_gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


gpu_check = load_gpu_check()

KERNEL_TABLE = """NVIDIA H200, bfloat16, 32 query heads, 8 KV heads, head_dim 128, block 16
| shape | Triton µs | SDPA µs | SDPA / Triton | KV GB/s | of HBM peak | max rel. diff |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
| decode b=32 ctx=1k | 40 | 60 | 1.50x | 1700 | {a}% | 3.1e-03 |
| decode b=64 ctx=2k | 90 | 140 | 1.55x | 3000 | {b}% | {diff} |
| prefill 4 x 512 | 50 | 45 | 0.90x | - | - | 2.0e-03 |
"""


def test_the_kernel_step_wants_decode_at_70_percent_of_peak_and_agreement() -> None:
    ok, figure = gpu_check.parse_kernel_bench(
        0, KERNEL_TABLE.format(a=35, b=74, diff="4e-03"), False
    )
    assert ok and "74% of HBM peak" in figure
    ok, _ = gpu_check.parse_kernel_bench(0, KERNEL_TABLE.format(a=35, b=60, diff="4e-03"), False)
    assert not ok
    ok, _ = gpu_check.parse_kernel_bench(0, KERNEL_TABLE.format(a=35, b=90, diff="2.0e-01"), False)
    assert not ok  # fast but wrong
    assert not gpu_check.parse_kernel_bench(1, "Traceback ...", False)[0]


def test_the_tests_step_wants_every_cuda_test_run_on_a_gpu() -> None:
    assert gpu_check.parse_pytest(0, "........\n8 passed in 4.20s\n", False) == (
        True,
        "8 passed in 4.20s",
    )
    assert not gpu_check.parse_pytest(0, "6 passed, 2 skipped in 4.20s", False)[0]
    assert not gpu_check.parse_pytest(1, "1 failed, 7 passed in 4.20s", False)[0]
    assert gpu_check.parse_pytest(0, "8 skipped, 463 deselected in 40.1s", True)[0]  # dry run


def test_the_run_step_wants_cuda_and_the_triton_backend() -> None:
    out = (
        "model Smollm2 135M   (cuda, bfloat16, attention triton, KV 90000 blocks x 16 tokens)\n"
        "output tokens 1850 (412.3 tok/s)   prompt tokens 2400\n"
        "TTFT p50 0.02 s  p99 0.05 s   TPOT p50 9 ms  p99 14 ms\n"
    )
    ok, figure = gpu_check.parse_run(0, out, False)
    assert ok and "412.3 tok/s" in figure and "TPOT p50 9 ms" in figure
    assert not gpu_check.parse_run(0, out.replace("attention triton", "attention torch"), False)[0]
    assert not gpu_check.parse_run(0, out.replace("(cuda,", "(cpu,"), False)[0]
    assert not gpu_check.parse_run(2, "schedtop: error: no CUDA device", False)[0]


def test_only_modules_with_cuda_tests_are_collected_on_the_device() -> None:
    files = gpu_check.cuda_test_files()
    assert "tests/test_attention_triton.py" in files and "tests/test_model_runner.py" in files
    assert "tests/test_scheduler.py" not in files


@pytest.mark.slow
def test_the_kernel_bench_dry_run_passes_the_checks_own_judgment() -> None:
    out = subprocess.run(
        [sys.executable, "bench/kernel_bench.py", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    ok, figure = gpu_check.parse_kernel_bench(0, out.stdout, True)
    assert ok, figure
    assert out.stdout.count("\n| ") == 4  # the header, its rule and two shapes
