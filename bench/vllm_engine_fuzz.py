"""Differential fuzzing through vLLM's real engine loop with async scheduling (issue 25).

    .venv/bin/python bench/vllm_engine_fuzz.py [--count 24] [--seed 0]
        [--vllm-python .venv-vllm/bin/python] [--keep DIR]

bench/vllm_diff_fuzz.py compares our scheduler with vLLM's scheduler driven by an oracle
loop. This one goes through what a vLLM user runs: vLLM's own LLMEngine (in-process
engine core, `async_scheduling=True`, so vLLM's AsyncScheduler and its two-batch queue)
with a model-free executor and recorder.vllm's RecordingScheduler (tests/vllm_engine.py,
which also checks after every step that the state the trace rebuilds is vLLM's live
one). Each recorded trace must then re-simulate to identical decisions with schedtop's
scheduler (`schedtop resim`) and with vLLM's (`schedtop resim --engine vllm`, all traces
in one vLLM process here).

Workloads (`async_workload`): block size 16 or 32, prefix caching on or off, half of them
preemption storms (a pool of 6-14 blocks for many long decodes), shared prefixes (hits
when caching is on), aborts (a quarter of the requests, some before their first step),
stop tokens, both policies, and the engine loop either drained after the last finish
(vLLM's busy loop) or stopped there (LLM.generate). Prints the counts, and the first
differences; exit 1 when any trace does not re-simulate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recorder.reader import TraceReader  # noqa: E402
from recorder.schema import Status, Step  # noqa: E402
from replays.diff import diff_traces  # noqa: E402
from replays.resim import resimulate  # noqa: E402

# Runs in vLLM's interpreter: replays.vllm_driver on every (trace, out) pair of a JSON list.
_VLLM_RESIM = """
import json, sys
from replays.vllm_driver import Driver, inputs_from_trace
for trace, out in json.load(open(sys.argv[1])):
    steps = Driver(inputs_from_trace(trace, {}), out).run()
    print(json.dumps({"trace": trace, "steps": steps}), flush=True)
"""


def async_workload(rng: random.Random) -> dict[str, Any]:
    """One random async workload for tests/vllm_engine.py, with its loop's "drain"."""
    bs = rng.choice([16, 32])
    storm = rng.random() < 0.5
    num_blocks = rng.randint(6, 14) if storm else rng.randint(16, 80)
    capacity = (num_blocks - 1) * bs
    max_num_seqs = rng.choice([4, 8, 16])
    cfg: dict[str, Any] = {
        "block_size": bs,
        "num_blocks": num_blocks,
        "max_model_len": capacity,
        "max_num_batched_tokens": rng.choice([64, 128, 256, 2048]),
        "max_num_seqs": max_num_seqs,
        "policy": rng.choice(["fcfs", "priority"]),
        "long_prefill_token_threshold": rng.choice([0, 0, 32]),
        "enable_prefix_caching": rng.random() < 0.5,
    }
    prefixes = [[rng.randint(100, 120) for _ in range(rng.randint(bs, 3 * bs))] for _ in range(2)]
    requests = []
    for i in range(rng.randint(6, 20)):
        prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
        own = [rng.randint(1, 50) for _ in range(rng.randint(1, 2 * bs))]
        max_tokens = rng.randint(1, 80 if storm else 40)
        prompt = (prefix + own)[: max(1, capacity - max_tokens - 1)]
        max_tokens = min(max_tokens, capacity - len(prompt))
        r: dict[str, Any] = {
            "id": f"r{i}",
            "arrival_step": rng.choice([0, 0, rng.randint(0, 40)]),
            "prompt_token_ids": prompt,
            "max_tokens": max_tokens,
            "output_token_ids": [rng.randint(1, 60) for _ in range(max_tokens)],
            "priority": rng.randint(0, 2),
        }
        if rng.random() < 0.25:
            r["abort_step"] = r["arrival_step"] + rng.choice([0, rng.randint(1, 30)])
        if rng.random() < 0.15:
            r["stop_token_ids"] = [r["output_token_ids"][rng.randrange(max_tokens)]]
        requests.append(r)
    return {"workload": {"config": cfg, "requests": requests}, "drain": rng.random() < 0.5}


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env["SCHEDTOP_SNAPSHOT_INTERVAL"] = "16"
    return env


@dataclass
class Outcome:
    """What the fuzz found, over every workload."""

    runs: int = 0
    steps: int = 0
    preemptions: int = 0
    aborts: int = 0
    hit_tokens: int = 0
    caching_off: int = 0
    drained: int = 0
    block_sizes: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.runs} async workloads through vLLM's LLMEngine ({self.steps} steps, "
            f"{self.preemptions} preemptions, {self.aborts} aborts, {self.hit_tokens} "
            f"prefix-hit tokens; {self.caching_off} with prefix caching off, block sizes "
            f"{dict(sorted(self.block_sizes.items()))}, {self.drained} drained): "
            f"{self.runs - len(self.problems)} re-simulate exactly with both engines, "
            f"{len(self.problems)} do not"
        )


def fuzz(count: int, seed: int, vllm_python: str, root: Path) -> Outcome:
    rng = random.Random(seed)
    items = {f"seed{seed}_{i}": async_workload(rng) for i in range(count)}
    spec = {
        "root": str(root),
        "check": True,
        "runs": [
            {"name": name, "multiprocess": False, "async_scheduling": True, **item}
            for name, item in items.items()
        ],
    }
    (root / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run(
        [vllm_python, "-m", "tests.vllm_engine", str(root / "spec.json"), str(root / "out.json")],
        cwd=ROOT,
        env=vllm_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"vLLM's engine loop failed:\n{proc.stderr[-3000:]}")
    results = json.loads((root / "out.json").read_text())
    outcome = Outcome()
    traces: dict[str, Path] = {}
    for name, item in items.items():
        outcome.runs += 1
        cfg = item["workload"]["config"]
        outcome.caching_off += not cfg["enable_prefix_caching"]
        outcome.drained += item["drain"]
        bs = cfg["block_size"]
        outcome.block_sizes[bs] = outcome.block_sizes.get(bs, 0) + 1
        if "error" in results[name]:
            outcome.problems.append(f"{name}: vLLM's run failed: {results[name]['error']}")
            continue
        traces[name] = trace = next((root / name).glob("*.trace"))
        checks = (root / name / "check.jsonl").read_text().splitlines()
        bad = [c for c in map(json.loads, checks) if c["problem"]]
        if bad:
            outcome.problems.append(f"{name}: trace state differs from vLLM's: {bad[0]}")
            continue
        with TraceReader(trace) as reader:
            steps = list(reader.steps())
        outcome.steps += len(steps)
        outcome.preemptions += sum(len(s.preemptions) for s in steps)
        outcome.aborts += count_aborts(steps)
        outcome.hit_tokens += sum(sum(s.kv_events.hit_tokens) for s in steps)
        ours = resimulate(trace)
        if not ours.reproduced or ours.num_steps != ours.num_recorded_steps:
            d = ours.divergence
            where = f"step {d.step}: {d.fields}" if d else "step count"
            outcome.problems.append(f"{name}: schedtop resim differs at {where}")
    pairs = [(str(t), str(t.with_name("vllm-resim.out"))) for t in traces.values()]
    (root / "pairs.json").write_text(json.dumps(pairs))
    # As `schedtop resim --engine vllm` runs it: not on vLLM's CPU platform, which would
    # turn async scheduling off.
    env = {k: v for k, v in vllm_env().items() if k != "VLLM_TARGET_DEVICE"}
    proc = subprocess.run(
        [vllm_python, "-c", _VLLM_RESIM, str(root / "pairs.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"vLLM's re-simulation failed:\n{proc.stderr[-3000:]}")
    for name, trace in traces.items():
        d = diff_traces(trace, trace.with_name("vllm-resim.out"))
        if d.first_step is not None:
            outcome.problems.append(f"{name}: resim --engine vllm differs at {d.first_step}")
    return outcome


def count_aborts(steps: list[Step]) -> int:
    return sum(1 for s in steps for f in s.finishes if f.status == Status.FINISHED_ABORTED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("SCHEDTOP_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python")),
    )
    ap.add_argument("--keep", metavar="DIR", help="keep the traces here")
    args = ap.parse_args()
    if args.keep:
        root = Path(args.keep)
        root.mkdir(parents=True, exist_ok=True)
        outcome = fuzz(args.count, args.seed, args.vllm_python, root)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            outcome = fuzz(args.count, args.seed, args.vllm_python, Path(tmp))
    print(outcome.summary())
    for problem in outcome.problems[:10]:
        print(f"  {problem[:300]}")
    sys.exit(1 if outcome.problems else 0)


if __name__ == "__main__":
    main()
