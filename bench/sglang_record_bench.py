"""What recording costs inside SGLang: its engine with the schedtop plugin against the
same engine without it, side by side.

    $SCHEDTOP_SGLANG_PYTHON bench/sglang_record_bench.py [--requests 32] [--prompt 64]
        [--output 64] [--repeats 7] [--max-running 32]

Runs in an interpreter that has SGLang 0.5.23. Two engines (SGLang's real engine on the CPU
with random weights and a tiny Llama, as tests/sglang_engine.py runs it) live at once in
two worker processes, one with SGLANG_PLUGINS=schedtop recording a trace, one with no
plugin; each round sends both the same batch (REQUESTS prompts of PROMPT tokens, in groups
of four sharing half their prompt, OUTPUT tokens each), one engine after the other,
alternating which goes first (so that a busy machine weighs on both alike). Per round it
measures the batch's wall time at the client and the CPU time of SGLang's scheduler
process (where the recorder's hooks and its writer thread run). The tiny model makes a
step cheap, so the scheduler's share of the time, and the recorder's, is at its largest:
a real model's forward passes would dilute both. Target (issue 29): at most +3%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def scheduler_cpu_s() -> float:
    """CPU seconds of this worker's SGLang scheduler process (threads included)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                t = child.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            continue
    return total


def worker(args: argparse.Namespace) -> None:
    """One engine; a line "SEED" on stdin runs a round, answered by a JSON line."""
    import sglang as sgl

    from replays.sglang_driver import cpu_engine_args
    from tests.sglang_engine import TINY_LLAMA

    model = Path(tempfile.mkdtemp(prefix="schedtop-bench-model-"))
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = sgl.Engine(
        **cpu_engine_args(str(model)),
        max_total_tokens=8192,
        max_running_requests=args.max_running,
        # the engine not being measured sleeps instead of polling: on a small machine
        # its busy loop would take CPU from the one that is
        sleep_on_idle=True,
    )
    params = {"max_new_tokens": args.output, "temperature": 0.0, "ignore_eos": True}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        rng = random.Random(int(line))
        prompts = []
        for _ in range(0, args.requests, 4):
            shared = [rng.randint(3, 500) for _ in range(args.prompt // 2)]
            for _ in range(4):
                prompts.append(shared + [rng.randint(3, 500) for _ in range(args.prompt // 2)])
        cpu0, t0 = scheduler_cpu_s(), time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        wall = time.perf_counter() - t0
        cpu = scheduler_cpu_s() - cpu0
        tokens = sum(len(o["output_ids"]) for o in outs)
        print(json.dumps({"wall_s": wall, "cpu_s": cpu, "tokens": tokens}), flush=True)
    engine.shutdown()


def stub_dir() -> Path:
    """A `vllm._custom_ops` stub package for both engines' processes: SGLang's rotary
    embedding imports it without CUDA, and the engine without the plugin has no stub of
    its own (recorder.sglang's is skipped where this one is found, so both run alike)."""
    d = Path(tempfile.mkdtemp(prefix="schedtop-bench-stub-")) / "vllm"
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "_custom_ops.py").write_text(
        "def rotary_embedding(*args, **kwargs):\n"
        "    raise RuntimeError('a stub: the CPU path never calls it')\n"
    )
    return d.parent


def start(kind: str, args: argparse.Namespace, trace: Path, stubs: Path) -> subprocess.Popen[str]:
    env = dict(os.environ)
    path = [str(ROOT), str(stubs), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    if kind == "recording":
        env["SGLANG_PLUGINS"] = "schedtop"
        env["SCHEDTOP_TRACE_FILE"] = str(trace)
    else:
        env["SGLANG_PLUGINS"] = "none"  # a name no plugin has: none is loaded
    argv = [sys.executable, __file__, "--worker"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"
    ]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def answer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            out: dict[str, Any] = json.loads(line)
            return out
    raise SystemExit(f"a worker died (exit {proc.wait()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    trace = Path(tempfile.mkdtemp(prefix="schedtop-bench-")) / "sglang.trace"
    stubs = stub_dir()
    procs = {kind: start(kind, args, trace, stubs) for kind in ("plain", "recording")}
    for proc in procs.values():
        answer(proc)  # ready
    rounds: dict[str, list[dict[str, Any]]] = {"plain": [], "recording": []}
    for r in range(args.repeats + 1):  # round 0 warms both up and is not counted
        order = ["plain", "recording"] if r % 2 == 0 else ["recording", "plain"]
        for kind in order:
            proc = procs[kind]
            assert proc.stdin is not None
            proc.stdin.write(f"{1000 + r}\n")
            proc.stdin.flush()
            got = answer(proc)
            if r:
                rounds[kind].append(got)
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=120)
    tokens = rounds["plain"][0]["tokens"]
    print(
        f"SGLang engine, CPU, tiny Llama: {args.requests} requests x {args.prompt} prompt + "
        f"{args.output} output tokens ({tokens} tokens a round), max_running "
        f"{args.max_running}; {args.repeats} rounds each, alternating"
    )
    print(f"{'median per round':<26} {'no plugin':>10} {'recording':>10} {'ratio':>8}")
    for key, name in (("wall_s", "wall time (s)"), ("cpu_s", "scheduler CPU (s)")):
        a = median(x[key] for x in rounds["plain"])
        b = median(x[key] for x in rounds["recording"])
        print(f"{name:<26} {a:>10.3f} {b:>10.3f} {b / a:>8.3f}")
    ratios = sorted(b["wall_s"] / a["wall_s"] for a, b in zip(rounds["plain"], rounds["recording"]))
    print(
        f"wall-time ratio per round: min {ratios[0]:.3f}, median {median(ratios):.3f}, "
        f"max {ratios[-1]:.3f}"
    )
    size = trace.stat().st_size if trace.exists() else 0
    steps = args.repeats + 1
    print(f"trace: {size:,} bytes for {steps} rounds ({size / steps / 1024:.1f} KiB a round)")


if __name__ == "__main__":  # SGLang spawns its scheduler process: the guard is needed
    main()
