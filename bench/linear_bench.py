"""The model's matrix products on the CPU: torch's F.linear (MKL) against oneDNN on
weights packed once (engine/model/cpu_linear.py), side by side in one process.

The weights are the default model's shapes (SmolLM2-135M: 30 layers of fused q/k/v, o,
fused gate/up and down, then the 49152-row LM head), random fp32, each layer its own
copy so that, as in the model, they stream from memory rather than sit in cache. For
each row count (a decode step of 4 requests is 4 rows, a verifying step of 4 requests
with 4 drafts each is 20, a prefill chunk up to the token budget), the table gives the
CPU milliseconds of one pass over all of them and the ratio.

    .venv/bin/python bench/linear_bench.py [--rows 1,4,20,64,512] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.cpu_linear import DenseLinear, PackedLinear, packed_status  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
LM_HEAD = (49152, 576)


def cpu_ms(fn: object, repeats: int) -> float:
    """The median CPU time of `repeats` calls, after one warm-up."""
    assert callable(fn)
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,20,64,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if packed_status() != "ok":
        sys.exit(f"linear_bench: the packed path is not available: {packed_status()}")
    gen = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(*shape, generator=gen) for shape in SHAPES.values() for _ in range(LAYERS)
    ]
    weights.append(torch.randn(*LM_HEAD, generator=gen))
    impls = [DenseLinear(), PackedLinear()]
    packed = [[impl.pack(w) for w in weights] for impl in impls]
    mib = sum(w.numel() for w in weights) * 4 / 2**20
    print(
        f"{len(weights)} weight matrices ({mib:.0f} MiB fp32), "
        f"{args.threads} thread(s), CPU ms per pass (median of {args.repeats})"
    )
    print(f"{'rows':>5} {'F.linear':>10} {'oneDNN packed':>14} {'speed-up':>9}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in weights}
            ms = [
                cpu_ms(
                    lambda i=impl, p=ps, x=x: [i(x[w.shape[1]], pw) for w, pw in zip(weights, p)],
                    args.repeats,
                )
                for impl, ps in zip(impls, packed)
            ]
            print(f"{rows:5} {ms[0]:10.1f} {ms[1]:14.1f} {ms[0] / ms[1]:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
