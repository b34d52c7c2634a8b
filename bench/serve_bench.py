"""`schedtop serve` under load, against offline `LLMEngine.generate()` of the same requests,
in one run, on the default model.

1. Throughput: N concurrent streaming clients (32) send R requests each (2) through HTTP;
   the same requests then go through offline generate() in this process (the server is
   stopped by then, so they do not share the CPU). Prompts of 16-96 random tokens, M new
   tokens each (64) with EOS ignored, greedy. Table: throughput, TTFT and ITL p50/p99,
   server / offline ratios. TTFT and ITL are what the clients saw (HTTP, SSE parsing
   included) against what the offline engine's clock saw.
2. Load: L requests (500) from the same N clients, random lengths (8-48 new tokens), a
   quarter of the clients leave mid-stream at a random token. Every request must finish
   or be aborted (client side and /metrics agree), no KV block may leak (the trace's last
   step has every block free), and the server's RSS must stay flat (sampled after the
   first tenth of the requests and at the end).

    .venv/bin/python bench/serve_bench.py [--clients 32] [--per-client 2] [--max-tokens 64]
                                          [--load 500] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.records import percentile  # noqa: E402


@dataclass
class Run:
    """One side's measurements."""

    name: str  # server or offline
    tokens: int = 0  # output tokens
    wall_s: float = 0.0  # first request sent to last token
    ttft: list[float] = field(default_factory=list)  # per request
    itl: list[float] = field(default_factory=list)  # every gap between tokens

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 96))] for _ in range(n)]


# -- the server ------------------------------------------------------------------------------


class Server:
    def __init__(self, trace_dir: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "tui.cli",
            "serve",
            "--port",
            "0",
            "--trace-dir",
            str(trace_dir),
            # more `schedtop serve` options for an experiment, e.g. "--num-threads 2"
            *os.environ.get("SCHEDTOP_BENCH_SERVE_ARGS", "").split(),
        ]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.url = ""
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if not self.url and " on http://" in line:
                    self.url = line.split(" on ", 1)[1].split()[0]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or not self.url:
            raise SystemExit("the server did not start")
        while httpx.get(self.url + "/health").status_code != 200:
            time.sleep(0.1)
        self.ps = psutil.Process(self.proc.pid)

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2**20

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("vllm:") and "_bucket" not in line:
                series, value = line.rsplit(" ", 1)
                name = series.split("{")[0]
                if "finished_reason=" in series:
                    name += ":" + series.split('finished_reason="')[1].split('"')[0]
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        self.proc.send_signal(2)
        self.proc.wait(120)


async def stream_one(
    client: httpx.AsyncClient, body: dict[str, Any], leave_after: int | None
) -> tuple[int, float | None, list[float], bool]:
    """(tokens, ttft, gaps, finished): one streamed request, left after `leave_after`
    token chunks when given."""
    t0 = time.perf_counter()
    ttft = None
    gaps: list[float] = []
    last = t0
    chunks = tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return tokens, ttft, gaps, True
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return chunks, ttft, gaps, False  # about one token a chunk
    return tokens, ttft, gaps, False


async def clients_run(
    url: str, bodies: list[dict[str, Any]], n_clients: int, leave: list[int | None]
) -> tuple[Run, int, int]:
    run = Run("server")
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    finished = left = 0
    limits = httpx.Limits(max_connections=n_clients + 4)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal finished, left
        while not queue.empty():
            i = queue.get_nowait()
            tokens, ttft, gaps, done = await stream_one(client, bodies[i], leave[i])
            run.tokens += tokens
            if ttft is not None:
                run.ttft.append(ttft)
            run.itl += gaps
            finished += done
            left += not done

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(n_clients)))
        run.wall_s = time.perf_counter() - t0
    return run, finished, left


# -- offline ---------------------------------------------------------------------------------


def offline_engine() -> Any:
    from schedtop_server.server import load_engine

    engine, _ = load_engine(None, {})
    return engine


def offline(engine: Any, ids: list[list[int]], max_tokens: list[int]) -> Run:
    """generate() of every request at once; TTFT from that moment (they all arrived)."""
    from engine.request import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    t0 = engine.clock()
    outs = engine.generate(ids, params)
    run = Run("offline", wall_s=engine.clock() - t0)
    for o in outs:
        run.tokens += len(o.output_token_ids)
        if o.first_token_time is not None:
            run.ttft.append(o.first_token_time - t0)
        run.itl += [b - a for a, b in zip(o.token_times, o.token_times[1:])]
    return run


def merged(runs: list[Run]) -> Run:
    out = Run(runs[0].name)
    for r in runs:
        out.tokens += r.tokens
        out.wall_s += r.wall_s
        out.ttft += r.ttft
        out.itl += r.itl
    return out


# -- report ----------------------------------------------------------------------------------


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def table(a: Run, b: Run) -> str:
    rows = [
        ("output tokens", f"{a.tokens}", f"{b.tokens}", ""),
        ("wall time", f"{a.wall_s:.1f} s", f"{b.wall_s:.1f} s", f"{a.wall_s / b.wall_s:.2f}x"),
        ("throughput", f"{a.tok_s:.1f} tok/s", f"{b.tok_s:.1f} tok/s", f"{a.tok_s / b.tok_s:.1%}"),
    ]
    for name, xs, ys in (("TTFT", a.ttft, b.ttft), ("ITL", a.itl, b.itl)):
        for q in (50, 99):
            x, y = percentile(xs, q), percentile(ys, q)
            ratio = f"{x / y:.2f}x" if x and y else ""
            rows.append((f"{name} p{q}", ms(x), ms(y), ratio))
    lines = [f"{'':<14} {'server':>14} {'offline':>14} {'server/offline':>15}"]
    lines += [f"{r[0]:<14} {r[1]:>14} {r[2]:>14} {r[3]:>15}" for r in rows]
    return "\n".join(lines)


def last_free_blocks(trace_dir: Path) -> tuple[int, int]:
    from recorder.multi import open_trace

    (path,) = trace_dir.iterdir()  # the run's directory of segments
    with open_trace(path) as reader:
        last = None
        for step in reader.steps():
            last = step
        usable = reader.header.num_blocks - 1
    return (last.free_blocks if last is not None else usable), usable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--per-client", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="server/offline pairs, alternated")
    ap.add_argument("--load", type=int, default=500, help="requests in the load scenario")
    ap.add_argument("--quick", action="store_true", help="8 clients, 16 tokens, 60 requests")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.per_client, args.max_tokens, args.load = 8, 1, 16, 60
    n = args.clients * args.per_client
    ids = prompts(n, 1)
    bodies = [
        {"prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": True, "stream_options": {"include_usage": True}}
        for p in ids
    ]  # fmt: skip

    engine = offline_engine()
    pairs: list[tuple[Run, Run]] = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(tmp)
        server = Server(trace_dir)
        try:
            # Warm-up on both sides; then server and offline alternate (the idle server
            # costs nothing while offline runs), so a noisy neighbour hurts both.
            asyncio.run(clients_run(server.url, bodies[:2], 2, [None, None]))
            offline(engine, ids[:2], [args.max_tokens] * 2)
            for _ in range(args.repeats):
                served, _, _ = asyncio.run(
                    clients_run(server.url, bodies, args.clients, [None] * n)
                )
                pairs.append((served, offline(engine, ids, [args.max_tokens] * n)))
            load = load_scenario(server, args)
        finally:
            server.stop()
        free, usable = last_free_blocks(trace_dir)

    print(f"## throughput: {args.clients} streaming clients x {args.per_client} requests, "
          f"{args.max_tokens} tokens each, default model, {args.repeats} runs a side")  # fmt: skip
    for i, (a, b) in enumerate(pairs):
        print(f"run {i + 1}: server {a.tok_s:.1f} tok/s, offline {b.tok_s:.1f} tok/s, "
              f"{a.tok_s / b.tok_s:.1%}")  # fmt: skip
    print(table(merged([a for a, _ in pairs]), merged([b for _, b in pairs])))
    print()
    print(f"## load: {args.load} requests from {args.clients} clients, a quarter leaving early")
    for k, v in load.items():
        print(f"{k:<30} {v}")
    print(
        f"{'free blocks at the end':<30} {free} of {usable}" + ("" if free == usable else "  LEAK")
    )


def load_scenario(server: Server, args: argparse.Namespace) -> dict[str, str]:
    rng = random.Random(7)
    ids = prompts(args.load, 2)
    bodies, leave = [], []
    for p in ids:
        m = rng.randint(4, 24)
        seed = rng.randrange(1 << 30)
        bodies.append({"prompt": p, "max_tokens": m, "temperature": 0.7, "seed": seed,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
        leave.append(rng.randint(1, m - 1) if rng.random() < 0.25 else None)
    before = server.metrics()
    tenth = max(1, args.load // 10)
    _, finished0, left0 = asyncio.run(
        clients_run(server.url, bodies[:tenth], args.clients, leave[:tenth])
    )
    rss_start = server.rss_mib()
    rss_peak = rss_start
    stop = threading.Event()

    def sample() -> None:
        nonlocal rss_peak
        while not stop.wait(0.5):
            rss_peak = max(rss_peak, server.rss_mib())

    threading.Thread(target=sample, daemon=True).start()
    run, finished, left = asyncio.run(
        clients_run(server.url, bodies[tenth:], args.clients, leave[tenth:])
    )
    stop.set()
    time.sleep(0.5)  # the last aborts' step
    rss_end = server.rss_mib()
    after = server.metrics()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    expected_left = sum(x is not None for x in leave)
    done = d.get("vllm:request_success_total:stop", 0) + d.get(
        "vllm:request_success_total:length", 0
    )
    finished += finished0
    left += left0
    aborted = d.get("vllm:request_success_total:abort", 0)
    return {
        "requests": f"{args.load} ({expected_left} meant to leave early)",
        "finished (clients / metrics)": f"{finished} / {done:.0f}",
        "left early (clients / aborts)": f"{left} / {aborted:.0f}",
        "all accounted for": "yes" if finished + left == args.load == done + aborted else "NO",
        "running / waiting at the end": f"{after.get('vllm:num_requests_running', 0):.0f} / "
        f"{after.get('vllm:num_requests_waiting', 0):.0f}",
        "KV usage at the end": f"{after.get('vllm:kv_cache_usage_perc', 0):.1%}",
        "throughput (tokens sent)": f"{run.tok_s:.1f} tok/s over {run.wall_s:.0f} s",
        "server RSS": f"{rss_start:.0f} MiB after the first tenth, peak {rss_peak:.0f}, "
        f"end {rss_end:.0f} ({rss_end - rss_start:+.0f} MiB)",
    }


if __name__ == "__main__":
    main()
