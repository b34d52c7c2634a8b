"""Differential fuzzing of our scheduler against vLLM's own, on random workloads.

    .venv/bin/python bench/vllm_diff_fuzz.py [--count 300] [--seed 0]
        [--oracle bench/vllm_oracle.py] [--vllm-python /tmp/vllm-venv/bin/python]
        [--spec] [--save-cases DIR]

--spec: every workload decodes speculatively with n-gram drafts (a `speculative_config`;
scripts that repeat themselves, so drafts are accepted and rejected), and vLLM runs under
bench/vllm_spec_oracle.py, which hands it the same drafts through
`update_draft_token_ids` and compares the drafts verified and accepted per request too.
--save-cases keeps the first identical workloads with vLLM's decisions, for the tests.

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
from engine.sim.workload import parse_workload  # noqa: E402
from engine.workload_file import WorkloadError  # noqa: E402

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


def spec_workload(rng: random.Random) -> dict[str, Any]:
    """A random workload decoding speculatively: n-gram drafts over scripts that often
    copy their prompt, so that drafts are both accepted and rejected."""
    w = random_workload(rng)
    k = rng.choice([1, 2, 3, 4])
    cfg = w["config"]
    # Our config refuses drafts with async scheduling (not supported together yet): such a
    # workload would only count as "different" without comparing a step.
    cfg.pop("async_scheduling", None)
    lo = rng.choice([1, 1, 2])
    cfg["speculative_config"] = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": rng.choice([lo, lo + 1, 4]),
        "prompt_lookup_min": lo,
    }
    if rng.random() < 0.5:
        # Small and tight: budgets that cut drafts, pools that preempt requests holding them.
        cfg["max_num_seqs"] = rng.choice([2, 3, 4, 6])
        cfg["max_num_batched_tokens"] = rng.choice([6, 8, 12, 16, 24])
        cfg["num_blocks"] = rng.randint(6, 24)
        cfg["block_size"] = rng.choice([4, 8])
        cfg.pop("max_num_active_seqs", None)
        cfg["enable_chunked_prefill"] = True
        w["requests"] = w["requests"][:8]
        for r in w["requests"]:
            r["prompt_token_ids"] = r["prompt_token_ids"][: rng.choice([1, 1, 5, 20, 40])]
            r["max_tokens"] = min(r["max_tokens"], 40)
            r["output_token_ids"] = r["output_token_ids"][: r["max_tokens"]]
    # vLLM asserts that a padded one-token admission keeps all 1 + k rows.
    if 0 < cfg["long_prefill_token_threshold"] <= k:
        cfg["long_prefill_token_threshold"] = 0
    for r in w["requests"]:
        if rng.random() < 0.6:
            prompt = r["prompt_token_ids"]
            start = rng.randrange(len(prompt))
            copied = prompt[start:] * (1 + r["max_tokens"] // max(1, len(prompt) - start))
            r["output_token_ids"] = copied[: r["max_tokens"]]
    return w


def spec_record(result: Any) -> dict[str, list[int]]:
    """Per request verifying drafts this step: [drafts verified, drafts accepted]."""
    rep, names = result.report, result.names
    accepted = {a.ref: a.accepted for a in rep.spec_accepted}
    return {
        names[s.ref]: [s.num_spec_tokens, accepted.get(s.ref, 0)]
        for s in rep.scheduled
        if s.num_spec_tokens
    }


def our_decisions(workload: dict[str, Any], spec: bool = False) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []

    def record(result: Any, engine: Any) -> None:
        got.append(decision_record(result, engine))
        if spec:
            got[-1]["spec"] = spec_record(result)

    simulate(parse_workload(workload), on_step=record)
    return got


def compare(
    workload: dict[str, Any], expected: list[dict[str, Any]], spec: bool = False
) -> str | None:
    try:
        got = our_decisions(workload, spec)
    except WorkloadError as e:
        return f"our run failed: {e}"
    keys = (*KEYS, "spec") if spec else KEYS
    for want, have in zip(expected, got):
        for key in keys:
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


def save_case(directory: Path, name: str, w: dict[str, Any], steps: list[Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.workload.json").write_text(json.dumps(w) + "\n")
    (directory / f"{name}.decisions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--oracle",
        default=str(Path(__file__).resolve().parent / "vllm_oracle.py"),
    )
    ap.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    ap.add_argument("--spec", action="store_true", help="n-gram speculative decoding")
    ap.add_argument("--save-cases", metavar="DIR", help="store identical cases here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    make = spec_workload if args.spec else random_workload
    workloads = [make(rng) for _ in range(args.count)]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "w.jsonl"
        src.write_text("".join(json.dumps(w) + "\n" for w in workloads))
        if args.spec:
            oracle = Path(__file__).resolve().parent / "vllm_spec_oracle.py"
            with src.open() as stdin:
                proc = subprocess.run(
                    [args.vllm_python, str(oracle)], stdin=stdin, capture_output=True, text=True
                )
        else:
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
        problem = compare(w, result["steps"], args.spec)
        if problem:
            diffs.append((i, problem))
        else:
            same += 1
            if args.save_cases and same <= 100:
                save_case(Path(args.save_cases), f"seed{args.seed}_{i}", w, result["steps"])
    print(
        f"{args.count} workloads: {same} identical, {len(diffs)} different, "
        f"{stalls} where vLLM stalls (not compared)"
    )
    for i, problem in diffs[:10]:
        print(f"  workload #{i} (seed {args.seed}): {problem[:300]}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
