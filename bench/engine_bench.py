"""Ours (continuous batching over paged KV) against its peers on one workload, in one run:
Hugging Face transformers' generate() in static batches of 8 with left padding, and
llama.cpp on the same GGUF file, one sequence at a time through its Python API and, when
its server binary is at hand, with its own parallel slots (continuous batching).

The workload: N requests (64; 16 with --quick), prompts of 32-512 random tokens, 16-256
new tokens each with EOS ignored, greedy, Poisson arrivals. transformers serves them in
arrival order, 8 at a time: a batch starts when its last request has arrived and the
previous batch is done, and runs to its longest request. llama.cpp's Python API serves
them one at a time in arrival order; its server gets each request at its arrival time,
streamed. Runs alternate (ours, then each peer) so that a noisy neighbour hurts all; the
table reports every run and the ratios. Every engine of a pair runs with the same CPU
thread count: --threads, or the faster of one thread and all cores, measured before the
pair (on a busy machine one thread wins).

Peers are optional: one that is not installed is skipped, and the bench says so.
transformers comes with the dev extras. llama.cpp is not a dependency of this project:
build llama-cpp-python from source in a venv of its own, outside the repository (about
10 minutes on 2 cores; it compiles llama.cpp), and optionally llama.cpp's server from the
same sources (paths relative to the repository; SRC is any scratch directory):

    SRC=$(mktemp -d)
    python3 -m venv ../venv-llamacpp
    CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 19 ../venv-llamacpp/bin/pip install \
        llama-cpp-python==0.3.36
    # the server (optional): llama.cpp as vendored in the same sdist
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$SRC"
    tar xzf "$SRC"/llama_cpp_python-0.3.36.tar.gz -C "$SRC"
    cmake -S "$SRC"/llama_cpp_python-0.3.36/vendor/llama.cpp -B ../llama-server-build \
        -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    nice -n 19 cmake --build ../llama-server-build --target llama-server -j1

    .venv/bin/python bench/engine_bench.py [--quick] [--repeats 2] [--threads N] \
        [--llamacpp-python ../venv-llamacpp/bin/python] \
        [--llamacpp-server ../llama-server-build/bin/llama-server]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.api import RunWorkload, build_engine, run_workload  # noqa: E402
from engine.model.loader import default_model_path, load_model  # noqa: E402
from engine.model.threads import ThreadTuner  # noqa: E402
from engine.model.workload import WorkloadRequest  # noqa: E402
from engine.records import percentile  # noqa: E402

HF_BATCH = 8
LLAMACPP_PEER = Path(__file__).with_name("_llamacpp_peer.py")
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
    cpu_s: float = 0.0  # CPU seconds the engine's process used: what a neighbour cannot move

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def tok_cpu_s(self) -> float:
        return self.output_tokens / self.cpu_s if self.cpu_s else 0.0


def cpu_seconds(who: int) -> float:
    """User + system CPU seconds of this process (RUSAGE_SELF) or its reaped children."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


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
    cpu0 = cpu_seconds(resource.RUSAGE_SELF)
    s = run_workload(w, engine=engine)
    cpu = cpu_seconds(resource.RUSAGE_SELF) - cpu0
    name = f"schedtop {options['max_num_seqs']}/{options['max_num_batched_tokens']}"
    n_threads = options["num_threads"]
    ttft = [t.ttft for t in s.times.values() if t.ttft is not None]  # the fold's (docs/metrics.md)
    tpot = [t.tpot for t in s.times.values() if t.tpot is not None]
    return Result(name, n_threads, s.output_tokens, s.elapsed_s, ttft, tpot, cpu)


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
    cpu0 = cpu_seconds(resource.RUSAGE_SELF)
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
    res.cpu_s = cpu_seconds(resource.RUSAGE_SELF) - cpu0
    return res


def load_transformers(dtype: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()


def llamacpp_python(given: str | None) -> tuple[str | None, str]:
    """An interpreter that can import llama_cpp: the one given, $LLAMACPP_PYTHON, or
    this one; None and the reason when there is none."""
    for python in (given, os.environ.get("LLAMACPP_PYTHON"), sys.executable):
        if not python:
            continue
        probe = subprocess.run(
            [python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120
        )
        if probe.returncode == 0:
            return python, "ok"
        if python == given:
            return None, f"{given} cannot import llama_cpp"
    return None, "llama_cpp is not installed (see this file's docstring; --llamacpp-python)"


def llamacpp_server(given: str | None) -> tuple[str | None, str]:
    """llama.cpp's server binary: the one given, $LLAMACPP_SERVER, or llama-server on PATH."""
    for path in (given, os.environ.get("LLAMACPP_SERVER"), shutil.which("llama-server")):
        if path and os.access(path, os.X_OK):
            return path, "ok"
        if path and path == given:
            return None, f"{given} is not an executable"
    return None, "no llama-server binary (see this file's docstring; --llamacpp-server)"


def run_llamacpp(
    python: str, w: RunWorkload, threads: int, server: str | None = None, slots: int = 0
) -> Result:
    """One run of llama.cpp in its own interpreter (bench/_llamacpp_peer.py)."""
    job = {
        "mode": "server" if server else "python",
        "server": server,
        "slots": slots,
        "model": str(default_model_path()),
        "threads": threads,
        "requests": [
            {
                "prompt": r.prompt_token_ids,
                "arrival": r.arrival_time,
                "max_tokens": int(r.sampling["max_tokens"]),
            }
            for r in w.requests
        ],
    }
    cpu0 = cpu_seconds(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [python, str(LLAMACPP_PEER)], input=json.dumps(job), capture_output=True, text=True
    )
    cpu = cpu_seconds(resource.RUSAGE_CHILDREN) - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp peer failed: {proc.stderr.strip()[-2000:]}")
    res = json.loads(proc.stdout)
    name = f"llama.cpp server, {slots} slots" if server else "llama.cpp, 1 at a time"
    out = res["output_tokens"]
    return Result(name, threads, out, res["total_s"], res["ttft"], res["tpot"], cpu)


def row(r: Result) -> str:
    def ms(values: list[float], q: float) -> str:
        v = percentile(values, q)
        return "-" if v is None else f"{v * 1000:.0f}"

    return (
        f"| {r.engine} | {r.threads} | {r.tok_s:.1f} | {r.total_s:.1f} | {ms(r.ttft, 50)} | "
        f"{ms(r.ttft, 99)} | {ms(r.tpot, 50)} | {ms(r.tpot, 99)} | {r.cpu_s:.1f} | "
        f"{r.tok_cpu_s:.1f} |"
    )


def ratios(name: str, pairs: list[tuple[Result, Result]]) -> None:
    tput = [o.tok_s / t.tok_s for o, t in pairs]
    cpu = [o.tok_cpu_s / t.tok_cpu_s if t.tok_cpu_s else 0.0 for o, t in pairs]
    tpot = [(percentile(t.tpot, 99) or 0) / (percentile(o.tpot, 99) or 1) for o, t in pairs]
    ttft = [(percentile(t.ttft, 50) or 0) / (percentile(o.ttft, 50) or 1) for o, t in pairs]

    def fmt(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f}x ({', '.join(f'{x:.2f}' for x in xs)})"

    print(f"| {name} | {fmt(tput)} | {fmt(cpu)} | {fmt(tpot)} | {fmt(ttft)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 requests instead of 64")
    ap.add_argument("--requests", type=int, help="number of requests (overrides --quick)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of every engine to run")
    ap.add_argument("--gap", type=float, default=0.15, help="mean seconds between arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="CPU threads for every engine")
    ap.add_argument(
        "--ours",
        action="append",
        metavar="SEQS/TOKENS",
        help="our max_num_seqs/max_num_batched_tokens; repeatable, each runs in "
        "every pair (default: 32/512, the CPU defaults)",
    )
    ap.add_argument("--kv-cache-memory", default="2GiB", help="our KV pool")
    ap.add_argument("--attention-backend", default="auto", help="ours: auto, cpu or torch")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and activations of ours and transformers alike (llama.cpp runs the "
        "GGUF's own Q4_1)",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-python", help="an interpreter with llama-cpp-python")
    ap.add_argument("--llamacpp-server", help="llama.cpp's llama-server binary")
    ap.add_argument("--server-slots", type=int, default=32, help="llama-server's -np")
    args = ap.parse_args()
    n = args.requests or (16 if args.quick else 64)
    loaded = load_model()
    w = make_workload(n, args.seed, args.gap, loaded.spec.vocab_size)
    hf = None
    if not args.skip_transformers:
        try:
            hf = load_transformers(args.dtype)
        except ImportError as e:
            print(f"transformers: skipped ({e})")
    llama_py = server = None
    if not args.skip_llamacpp:
        llama_py, why = llamacpp_python(args.llamacpp_python)
        if llama_py is None:
            print(f"llama.cpp (Python API): skipped: {why}")
        server, why = llamacpp_server(args.llamacpp_server)
        if server is None:
            print(f"llama.cpp server: skipped: {why}")
    configs = [tuple(int(x) for x in c.split("/")) for c in (args.ours or ["32/512"])]
    rounds: list[tuple[list[Result], list[Result]]] = []
    for _ in range(args.repeats):
        threads = pick_threads(args.threads)
        ours = []
        for seqs, budget in configs:
            options = {
                "max_num_seqs": seqs,
                "max_num_batched_tokens": budget,
                "kv_cache_memory": args.kv_cache_memory,
                "num_threads": threads,
                "attention_backend": args.attention_backend,
                "dtype": args.dtype,
            }
            ours.append(run_ours(w, loaded, options))
            print(row(ours[-1]), flush=True)
        peers = []
        if hf is not None:
            peers.append(run_transformers(w, hf))
            print(row(peers[-1]), flush=True)
        if llama_py is not None:
            peers.append(run_llamacpp(llama_py, w, threads))
            print(row(peers[-1]), flush=True)
        if server is not None:
            # the server's client side needs only the standard library: this interpreter
            peers.append(run_llamacpp(sys.executable, w, threads, server, args.server_slots))
            print(row(peers[-1]), flush=True)
        rounds.append((ours, peers))
    print(
        f"\n{n} requests, prompts 32-512, outputs 16-256 (EOS ignored), mean arrival gap "
        f"{args.gap} s; ours as max_num_seqs/max_num_batched_tokens, KV "
        f"{args.kv_cache_memory}; {args.dtype} (ours and transformers)\n"
    )
    print(
        "| engine | threads | output tok/s | total s | TTFT p50 ms | TTFT p99 ms | "
        "TPOT p50 ms | TPOT p99 ms | CPU s | tok/CPU-s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for ours, peers in rounds:
        for r in ours + peers:
            print(row(r))
    print("\nratios, median over rounds (each round's in brackets):\n")
    print(
        "| ours vs peer | throughput ours/theirs | per CPU-s ours/theirs | "
        "TPOT p99 theirs/ours | TTFT p50 theirs/ours |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for i, (seqs, budget) in enumerate(configs):
        for p, peer in enumerate(rounds[0][1]):
            pairs = [(o[i], peers[p]) for o, peers in rounds]
            ratios(f"schedtop {seqs}/{budget} vs {peer.engine}", pairs)


if __name__ == "__main__":
    main()
