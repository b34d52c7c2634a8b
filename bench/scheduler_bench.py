"""CPU cost of one scheduler step: schedule() + update_from_output(), ours vs vLLM's.

    .venv/bin/python bench/scheduler_bench.py [--vllm-python PATH] [--repeats 3] [--clock cpu]

vLLM is optional and never a project dependency: pass the interpreter of a venv that has
it (`python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm`), or set
VLLM_PYTHON. Runs alternate ours / vLLM so machine contention hits both alike; the
table shows medians and the ratio (ours / vLLM: below 1 means faster). Each side times
its steps by the stepping thread's CPU time (--clock cpu, the default), which the other
jobs of a shared machine move far less than elapsed time (--clock wall)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._sched_workloads import CASES, CLOCKS, Case  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv.hashing import BlockHasher  # noqa: E402
from engine.outputs import ModelRunnerOutput  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

HERE = Path(__file__).resolve().parent


def ours(case: Case, clock: str = "cpu") -> float:
    """Mean µs per step over `case.steps` steady-state steps."""
    now = CLOCKS[clock]
    cfg = EngineConfig(
        block_size=case.block_size,
        num_blocks=case.num_blocks,
        max_num_batched_tokens=case.budget,
        max_num_seqs=case.max_num_seqs,
        max_model_len=65536,
        long_prefill_token_threshold=case.threshold,
    )
    sched = Scheduler(cfg)
    hasher = BlockHasher(case.block_size)
    rank = 0

    def add(length: int, max_tokens: int) -> None:
        nonlocal rank
        sched.add_request(
            Request(
                f"r{rank}",
                case.prompt(rank, length),
                SamplingParams(max_tokens=max_tokens),
                arrival_time=float(rank),
                block_hasher=hasher,
            )
        )
        rank += 1

    for _ in range(case.num_decodes):
        add(8, 1_000_000)

    def step() -> float:
        if case.prefill_len:
            add(case.prefill_len, 4)
        t0 = now()
        out, _ = sched.schedule()
        t1 = now()
        result = fake_output(sched, out)
        t2 = now()
        sched.update_from_output(out, result)
        sched.end_step()
        # The engine takes its finished requests every step (EngineCore.take_finished);
        # left in the scheduler, each finished 2000-token request and its lists stayed
        # alive for the whole run, for every later garbage collection to walk.
        sched.take_finished()
        return (t1 - t0) + (now() - t2)

    for _ in range(3 + case.num_decodes * 8 // case.budget):
        step()
    return sum(step() for _ in range(case.steps)) / case.steps * 1e6


def fake_output(sched: Scheduler, out) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
    ids = list(out.num_scheduled_tokens)
    reqs = sched.requests
    toks = [[5] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
    return ModelRunnerOutput(ids, toks)


def vllm(python: str, case: Case, clock: str = "cpu") -> float | None:
    proc = subprocess.run(
        [python, str(HERE / "_vllm_peer.py"), case.name, clock], capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-2000:])
        return None
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--vllm-python", default=os.environ.get("VLLM_PYTHON", "/tmp/vllm-venv/bin/python")
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="run only cases whose name contains this")
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: the stepping thread's CPU time (default); wall: elapsed time",
    )
    args = ap.parse_args()
    have_vllm = Path(args.vllm_python).exists()
    if not have_vllm:
        print(f"(no vLLM at {args.vllm_python}: showing ours only)")
    print(f"clock: {args.clock}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    header = (
        f"{'case':<24} {'ours µs/step':>13} {'ours µs/req':>12} "
        f"{'vLLM µs/step':>13} {'vLLM µs/req':>12} {'ours/vLLM':>10}"
    )
    print(header)
    print("-" * len(header))
    for case in CASES:
        if args.only and args.only not in case.name:
            continue
        a, b = [], []
        for _ in range(args.repeats):
            a.append(ours(case, args.clock))
            if have_vllm:
                v = vllm(args.vllm_python, case, args.clock)
                if v is not None:
                    b.append(v)
        oa = statistics.median(a)
        n = case.num_decodes + (1 if case.prefill_len else 0)
        row = f"{case.name:<24} {oa:>13.0f} {oa / n:>12.2f}"
        if b:
            ob = statistics.median(b)
            row += f" {ob:>13.0f} {ob / n:>12.2f} {oa / ob:>10.2f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
