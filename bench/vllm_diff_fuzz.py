"""Differential fuzzing of our scheduler against vLLM's own, on random workloads.

    .venv/bin/python bench/vllm_diff_fuzz.py [--count 300] [--seed 0]
        [--oracle ../shared/fidelity/vllm_oracle.py] [--vllm-python /tmp/vllm-venv/bin/python]

Generates workloads in the fidelity format (pools from tiny to roomy, shared prefixes,
staggered arrivals, both policies, thresholds, watermark, full-prompt check on and off,
prefix caching on and off), runs each through vLLM (via the oracle script, imported once
in vLLM's interpreter) and through `schedtop sim`'s engine, and compares every step:
scheduled ids/counts/order, preemptions, admissions, finishes, free blocks, queue orders,
computed tokens and block tables. Workloads on which vLLM stalls (a request that can never
fit: vLLM retries it forever, we end it with FINISHED_ERROR) are counted, not compared.
vLLM is never a project dependency; this tool is for developers who have it."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sim.decisions import decision_record  # noqa: E402
from engine.sim.driver import simulate  # noqa: E402
from engine.sim.workload import WorkloadError, parse_workload  # noqa: E402

KEYS = (
    "scheduled",
    "preempted",
    "preemptions",
    "admitted",
    "finished",
    "num_free_blocks",
    "num_free_blocks_after_schedule",
    "running",
    "waiting",
    "num_computed_tokens",
    "block_tables",
    "arrived",
    "sampled",
)

BATCH = """
import json, sys
sys.path.insert(0, sys.argv[1])
import vllm_oracle
for line in open(sys.argv[2]):
    item = json.loads(line)
    try:
        out = {"steps": vllm_oracle.run(item)["steps"]}
    except SystemExit as e:
        out = {"error": str(e)}
    print(json.dumps(out), flush=True)
"""


def random_workload(rng: random.Random) -> dict[str, Any]:
    bs = rng.choice([4, 8, 16, 16, 32])
    max_model_len = rng.choice([64, 128, 256, 512, 4096])
    num_blocks = rng.randint(4, 300)
    max_num_seqs = rng.choice([1, 2, 3, 4, 8, 16, 32])
    cfg: dict[str, Any] = dict(
        block_size=bs,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(max_num_seqs, rng.choice([8, 16, 32, 64, 100, 256, 2048])),
        max_num_seqs=max_num_seqs,
        policy=rng.choice(["fcfs", "priority"]),
        long_prefill_token_threshold=rng.choice([0, 0, 0, 8, 16, 33, 64]),
        enable_prefix_caching=rng.random() < 0.8,
    )
    if cfg["long_prefill_token_threshold"] > max_model_len:
        cfg["long_prefill_token_threshold"] = 0
    if rng.random() < 0.3:
        cfg["watermark"] = rng.choice([0.01, 0.05, 0.1, 0.2])
    if rng.random() < 0.3:
        cfg["scheduler_reserve_full_isl"] = False
    if rng.random() < 0.1:
        cfg["long_prefill_token_threshold_adaptive"] = True
    if rng.random() < 0.1:
        cfg["max_num_active_seqs"] = rng.randint(1, max_num_seqs)
    if rng.random() < 0.1 and cfg["max_num_batched_tokens"] >= max_model_len:
        cfg["enable_chunked_prefill"] = False
    if rng.random() < 0.5:
        cfg["async_scheduling"] = True
    room = min(max_model_len - 1, (num_blocks - 1) * bs)
    prefixes = [[rng.randint(1000, 1100) for _ in range(rng.randint(0, 3 * bs))] for _ in range(3)]
    requests = []
    for i in range(rng.randint(1, 30)):
        prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
        own = [rng.randint(0, 50) for _ in range(rng.choice([1, 8, 20, 40, 100, 300]))]
        prompt = (prefix + own)[: max(1, room)]
        max_tokens = rng.randint(1, 100)
        r: dict[str, Any] = dict(
            id=f"r{i}",
            arrival_step=rng.choice([0, 0, rng.randint(0, 100)]),
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            output_token_ids=[rng.randint(0, 50) for _ in range(rng.randint(0, max_tokens))],
        )
        if cfg["policy"] == "priority" or rng.random() < 0.2:
            r["priority"] = rng.randint(0, 3)
        requests.append(r)
    return {"config": cfg, "requests": requests}


def compare(workload: dict[str, Any], expected: list[dict[str, Any]]) -> str | None:
    got: list[dict[str, Any]] = []
    try:
        simulate(parse_workload(workload), on_step=lambda r, e: got.append(decision_record(r, e)))
    except WorkloadError as e:
        return f"our run failed: {e}"
    for want, have in zip(expected, got):
        for key in KEYS:
            if key == "sampled" and workload["config"].get("async_scheduling"):
                continue  # vLLM's side lists a batch's samples when it launches, ours on arrival
            a, b = want.get(key), have.get(key)
            if key == "scheduled":
                a, b = list(a.items()), list(b.items())
            if a != b:
                return f"step {want['step']}: {key}: vLLM {a} ours {b}"
    if len(expected) != len(got):
        return f"vLLM ran {len(expected)} steps, we ran {len(got)}"
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--oracle",
        default=str(Path(__file__).resolve().parent / "vllm_oracle.py"),
    )
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    workloads = [random_workload(rng) for _ in range(args.count)]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "w.jsonl"
        src.write_text("".join(json.dumps(w) + "\n" for w in workloads))
        proc = subprocess.run(
            [args.vllm_python, "-c", BATCH, str(Path(args.oracle).parent), str(src)],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        sys.exit(f"vLLM side failed:\n{proc.stderr[-3000:]}")
    same = stalls = 0
    diffs = []
    for i, (w, line) in enumerate(zip(workloads, proc.stdout.splitlines())):
        result = json.loads(line)
        if "error" in result:
            stalls += 1
            continue
        problem = compare(w, result["steps"])
        if problem:
            diffs.append((i, problem))
        else:
            same += 1
    print(
        f"{args.count} workloads: {same} identical, {len(diffs)} different, "
        f"{stalls} where vLLM stalls (not compared)"
    )
    for i, problem in diffs[:10]:
        print(f"  workload #{i} (seed {args.seed}): {problem[:300]}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
