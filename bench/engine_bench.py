"""Ours (continuous batching over paged KV) against Hugging Face transformers' generate()
in static batches of 8 with left padding, on one workload, in one process.

The workload: N requests (64; 16 with --quick), prompts of 32-512 random tokens, 16-256
new tokens each with EOS ignored, greedy, Poisson arrivals. transformers serves them in
arrival order, 8 at a time: a batch starts when its last request has arrived and the
previous batch is done, and runs to its longest request. Runs alternate A B A B so that
a noisy neighbour hurts both; the table reports every run and the ratios. Both engines of
a pair run with the same torch thread count: --threads, or the faster of one thread and
all cores, measured before the pair (on a busy machine one thread wins).

    .venv/bin/python bench/engine_bench.py [--quick] [--repeats 2] [--threads N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.api import RunWorkload, build_engine, percentile, run_workload  # noqa: E402
from engine.model.loader import default_model_path, load_model  # noqa: E402
from engine.model.threads import ThreadTuner  # noqa: E402
from engine.model.workload import WorkloadRequest  # noqa: E402

HF_BATCH = 8
MAX_THREADS = torch.get_num_threads()


@dataclass
class Result:
    """One engine's run over the workload."""

    engine: str  # who ran
    threads: int  # torch CPU threads during the run
    output_tokens: int  # useful tokens (each request's own max_tokens)
    total_s: float  # first arrival to last token
    ttft: list[float] = field(default_factory=list)  # per request
    tpot: list[float] = field(default_factory=list)  # per request

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.total_s


def make_workload(n: int, seed: int, gap_s: float, vocab: int) -> RunWorkload:
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        prompt = [rng.randrange(17, vocab) for _ in range(rng.randint(32, 512))]
        reqs.append(
            WorkloadRequest(
                f"r{i:02d}",
                prompt_token_ids=prompt,
                arrival_time=round(t, 3),
                sampling={
                    "max_tokens": rng.randint(16, 256),
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
        )
        t += rng.expovariate(1.0 / gap_s)
    return RunWorkload("engine bench", {}, reqs, "bench")


def run_ours(w: RunWorkload, loaded: Any, options: dict[str, Any]) -> Result:
    engine = build_engine(w, overrides=options, loaded=loaded)
    s = run_workload(w, engine=engine)
    name = f"schedtop {options['max_num_seqs']}/{options['max_num_batched_tokens']}"
    return Result(name, options["num_threads"], s.output_tokens, s.elapsed_s, s.ttft_s, s.tpot_s)


def pick_threads(fixed: int | None) -> int:
    """The same torch thread count for both engines of a pair: --threads, or measured
    now (on a busy machine one thread can beat two several times over)."""
    if fixed is not None:
        torch.set_num_threads(fixed)
        return fixed
    return ThreadTuner(max_threads=MAX_THREADS).probe()


class _StepClock:
    """A logits processor that only records when each generation step finished."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_transformers(w: RunWorkload, model: Any) -> Result:
    from transformers import LogitsProcessorList

    model.generation_config.eos_token_id = None  # ignore EOS, like the other engine
    model.generation_config.pad_token_id = 2
    res = Result("transformers", torch.get_num_threads(), 0, 0.0)
    t0 = time.perf_counter()
    free_at = t0
    last = t0
    for b in range(0, len(w.requests), HF_BATCH):
        batch = w.requests[b : b + HF_BATCH]
        start = max(free_at, t0 + batch[-1].arrival_time)
        time.sleep(max(0.0, start - time.perf_counter()))
        ids = [r.prompt_token_ids or [] for r in batch]
        width = max(len(p) for p in ids)
        input_ids = torch.tensor([[2] * (width - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
        wants = [int(r.sampling["max_tokens"]) for r in batch]
        clock = _StepClock()
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(wants),
                logits_processor=LogitsProcessorList([clock]),
            )
        for r, n in zip(batch, wants):
            res.output_tokens += n
            res.ttft.append(clock.times[0] - (t0 + r.arrival_time))
            if n > 1:
                res.tpot.append((clock.times[n - 1] - clock.times[0]) / (n - 1))
        free_at = last = clock.times[-1]
    res.total_s = last - (t0 + w.requests[0].arrival_time)
    return res


def load_transformers() -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def row(r: Result) -> str:
    def ms(values: list[float], q: float) -> str:
        v = percentile(values, q)
        return "-" if v is None else f"{v * 1000:.0f}"

    return (
        f"| {r.engine} | {r.threads} | {r.tok_s:.1f} | {r.total_s:.1f} | {ms(r.ttft, 50)} | "
        f"{ms(r.ttft, 99)} | {ms(r.tpot, 50)} | {ms(r.tpot, 99)} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--requests", type=int, help="number of requests (overrides --quick)")
    ap.add_argument("--repeats", type=int, default=2, help="A/B pairs to run")
    ap.add_argument("--gap", type=float, default=0.15, help="mean seconds between arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads for both engines")
    ap.add_argument(
        "--ours",
        action="append",
        metavar="SEQS/TOKENS",
        help="our max_num_seqs/max_num_batched_tokens; repeatable, each runs in "
        "every pair (default: 32/512, the CPU defaults)",
    )
    ap.add_argument("--kv-cache-memory", default="2GiB", help="our KV pool")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    n = args.requests or (16 if args.quick else 64)
    loaded = load_model()
    w = make_workload(n, args.seed, args.gap, loaded.spec.vocab_size)
    hf = None if args.skip_transformers else load_transformers()
    configs = [tuple(int(x) for x in c.split("/")) for c in (args.ours or ["32/512"])]
    results: list[tuple[list[Result], Result | None]] = []
    for _ in range(args.repeats):
        threads = pick_threads(args.threads)
        ours = []
        for seqs, budget in configs:
            ours.append(
                run_ours(
                    w,
                    loaded,
                    {
                        "max_num_seqs": seqs,
                        "max_num_batched_tokens": budget,
                        "kv_cache_memory": args.kv_cache_memory,
                        "num_threads": threads,
                    },
                )
            )
            print(row(ours[-1]), flush=True)
        theirs = run_transformers(w, hf) if hf is not None else None
        if theirs is not None:
            print(row(theirs), flush=True)
        results.append((ours, theirs))
    print(
        f"\n{n} requests, prompts 32-512, outputs 16-256 (EOS ignored), mean arrival gap "
        f"{args.gap} s; ours as max_num_seqs/max_num_batched_tokens, KV "
        f"{args.kv_cache_memory}\n"
    )
    print(
        "| engine | threads | output tok/s | total s | TTFT p50 ms | TTFT p99 ms | "
        "TPOT p50 ms | TPOT p99 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ours, theirs in results:
        for r in ours:
            print(row(r))
        if theirs is not None:
            print(row(theirs))
    for i, (seqs, budget) in enumerate(configs):
        pairs = [(o[i], t) for o, t in results if t is not None]
        if not pairs:
            continue
        tput = [o.tok_s / t.tok_s for o, t in pairs]
        tpot = [(percentile(t.tpot, 99) or 0) / (percentile(o.tpot, 99) or 1) for o, t in pairs]
        ttft = [(percentile(t.ttft, 50) or 0) / (percentile(o.ttft, 50) or 1) for o, t in pairs]
        print(f"\nschedtop {seqs}/{budget} vs transformers, per pair and median:")
        print(
            f"  throughput ours/theirs: {', '.join(f'{x:.2f}x' for x in tput)}; "
            f"median {statistics.median(tput):.2f}x"
        )
        print(
            f"  TPOT p99 theirs/ours (>1: ours lower): "
            f"{', '.join(f'{x:.2f}x' for x in tpot)}; median {statistics.median(tpot):.2f}x"
        )
        print(
            f"  TTFT p50 theirs/ours (>1: ours lower): "
            f"{', '.join(f'{x:.2f}x' for x in ttft)}; median {statistics.median(ttft):.2f}x"
        )


if __name__ == "__main__":
    main()
