"""The sampler's cost per step, plain and with vLLM's logits processing, side by side.

A batch of R requests (64) over the default model's vocabulary (49,152), each with a
history of P prompt and O output tokens (128, 64): SamplingBatch.from_params and
Sampler.__call__ (plus the logprobs, where asked) timed together, as the runner calls
them every step. Rows: greedy and sampled (temperature 0.8, top-p 0.95) without any
processing, the default path every existing workload takes, then with each knob on for
every request. The ratio column is each row against its plain counterpart.

Run it on two checkouts to compare the plain rows before and after a sampler change
(the processing rows are skipped where SamplingParams lacks the fields):

    .venv/bin/python bench/sampler_bench.py [--rows 64] [--vocab 49152] [--iters 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model import sampler as sampler_mod  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def timed(fn: Any, iters: int) -> float:
    """Median microseconds of one call (after two warm-up calls)."""
    fn()
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    rng = np.random.default_rng(0)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    prompts = rng.integers(0, args.vocab, (args.rows, args.prompt))
    outputs = rng.integers(0, args.vocab, (args.rows, args.output))
    sampler = sampler_mod.Sampler(cpu, 0)
    positions = [args.output] * args.rows

    def history(i: int) -> tuple[np.ndarray, np.ndarray]:
        return prompts[i], outputs[i]

    def step(params: SamplingParams) -> Any:
        batch_params = [params] * args.rows
        if "presence_penalty" in FIELDS:
            batch = sampler_mod.SamplingBatch.from_params(
                batch_params, positions, cpu, history, args.vocab
            )
        else:
            batch = sampler_mod.SamplingBatch.from_params(batch_params, positions, cpu)
        tokens = sampler(logits, batch)
        if getattr(batch, "logprobs", None) is not None:
            sampler_mod.token_logprobs(logits, tokens.tolist(), batch.logprobs)
        return tokens

    greedy = dict(temperature=0.0)
    sampled = dict(temperature=0.8, top_p=0.95)
    knobs: list[tuple[str, dict[str, Any]]] = [
        ("penalties (rep, freq, pres)", dict(repetition_penalty=1.2, frequency_penalty=0.5,
                                              presence_penalty=0.5)),
        ("logit_bias (4 tokens)", dict(logit_bias=((1, 5.0), (2, -5.0), (3, 1.0), (4, 2.0)))),
        ("min_p 0.05", dict(min_p=0.05)),
        ("logprobs 5", dict(logprobs=5)),
    ]  # fmt: skip
    print(f"{args.rows} rows x {args.vocab} vocabulary, {args.threads} thread(s), median of "
          f"{args.iters}; microseconds per step")  # fmt: skip
    print(f"{'':<32} {'greedy':>10} {'ratio':>7} {'sampled':>10} {'ratio':>7}")
    base_g = timed(lambda: step(SamplingParams(**greedy)), args.iters)
    base_s = timed(lambda: step(SamplingParams(**sampled)), args.iters)
    plain = "plain (the default path)"
    print(f"{plain:<32} {base_g:>10.0f} {'1.00x':>7} {base_s:>10.0f} {'1.00x':>7}")
    for name, extra in knobs:
        if not set(extra) <= FIELDS:
            print(f"{name:<32} {'(not in this checkout)':>36}")
            continue
        g_params = SamplingParams(**greedy, **extra)
        s_params = SamplingParams(**sampled, **extra)
        g = timed(lambda: step(g_params), args.iters)  # noqa: B023 - called at once
        s = timed(lambda: step(s_params), args.iters)  # noqa: B023 - called at once
        print(f"{name:<32} {g:>10.0f} {g / base_g:>6.2f}x {s:>10.0f} {s / base_s:>6.2f}x")


if __name__ == "__main__":
    main()
