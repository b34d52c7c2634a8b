"""Sweeps: N traces x 8 configs of S steps each, through `schedtop sweep`'s executors.

    .venv/bin/python bench/sweep_bench.py [--traces 64] [--steps 5000] [--jobs 2]
        [--serial-traces N] [--no-ray]

The traces are simulated once (a fleet of replicas: each its own seeded mix of prompts and
output lengths, about 32 requests running) and cached in /tmp/schedtop-bench/sweep/. Each
task is a time-driven what-if (`replays.whatif`) of one trace under one config, with a
given linear step-time model (simulated traces have no timings to fit). The grid's 8
points include each trace's recorded config (marked in the sweep's table), so a trace
is exactly 8 tasks.

It reports, side by side in one run: wall time with 1 worker (in-process), the process
pool and Ray (a local cluster of --jobs CPUs, started and stopped here), each executor's
speed-up over 1 worker, whether every executor produced the same rows, and Ray's own cost:
cluster start, and the round trip of one empty task. With --serial-traces N, the 1-worker
run covers only the first N traces and its time for all of them is extrapolated (said so
in the table)."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.sim.api import run_sim  # noqa: E402
from engine.sim.workload import parse_workload  # noqa: E402
from recorder.recorder import open_recording  # noqa: E402
from replays.costmodel import CostModel  # noqa: E402
from replays.sweep import parse_grid, plan, run_sweep, to_json  # noqa: E402

CACHE = Path("/tmp/schedtop-bench/sweep")
MODEL = CostModel(0.006, {"prefill_tokens": 4e-5, "decode_requests": 2e-4, "context_tokens": 2e-8})
# 8 points, one of them each trace's recorded config (512 tokens, 32 seqs, 1200 blocks): a
# smaller budget, more sequences, a pool small enough to preempt.
GRID = ["max_num_batched_tokens=256,512", "max_num_seqs=32,64", "num_blocks=400,1200"]


def make_trace(i: int, steps: int) -> Path:
    """A replica's trace of about `steps` steps, cached by (i, steps)."""
    path = CACHE / f"replica-{i:03d}-{steps}.trace"
    if path.exists():
        return path
    rng = random.Random(i)
    requests = []
    step = 0
    n = 0
    # ~32 running: a request every few steps, decoding 40-200 tokens
    while step < steps - 250:
        prompt = rng.randint(32, 320)
        out = rng.randint(40, 200)
        start = rng.randint(0, 50) * 100 + (i % 7) * 10_000  # shared prefixes across requests
        requests.append(
            {
                "id": f"r{n}",
                "arrival_step": step,
                "prompt_token_ids": list(range(start, start + prompt)),
                "output_token_ids": [(n * 31 + j) % 30000 for j in range(out)],
                "max_tokens": out,
            }
        )
        n += 1
        step += rng.choice((1, 2, 3, 4, 5, 6))
    config = {
        "block_size": 16,
        "num_blocks": 1200,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 32,
        "max_model_len": 4096,
        "max_steps": steps * 20,
    }
    w = parse_workload({"config": config, "requests": requests}, source="bench")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    run_sim(w, on_engine=lambda e: open_recording(e, tmp, live=False))
    tmp.rename(path)
    return path


def progress(name: str):  # type: ignore[no-untyped-def]
    """A progress line on stderr every 32 tasks: long runs are polled from a log."""
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done % 32 == 0 or done == total:
            dt = time.perf_counter() - start
            print(f"  {name}: {done}/{total} tasks, {dt:.0f} s", file=sys.stderr, flush=True)

    return report


def timed(fn):  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def ray_overheads(jobs: int) -> tuple[float, float, float]:
    """(cluster start s, first empty task s (a worker starts), median round trip of an
    empty task on a warm worker s)."""
    import ray

    _, start = timed(lambda: ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False))
    try:
        noop = ray.remote(num_cpus=1)(lambda: None)
        _, first = timed(lambda: ray.get(noop.remote()))
        trips = []
        for _ in range(50):
            _, dt = timed(lambda: ray.get(noop.remote()))
            trips.append(dt)
        return start, first, statistics.median(trips)
    finally:
        ray.shutdown()


def reading_cost(trace: str) -> float:
    """CPU ms per recorded step to read a trace into what-if's inputs (once per trace per
    worker, shared by its configs), best of 3."""
    from replays.whatif import _inputs, _read_inputs

    best = float("inf")
    for _ in range(3):
        _read_inputs.cache_clear()
        cpu = time.process_time()
        inputs = _inputs(trace)
        best = min(best, (time.process_time() - cpu) * 1e3 / inputs.num_steps)
    _read_inputs.cache_clear()  # the 1-worker pass reads it again, like every trace
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--serial-traces", type=int, default=None)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()

    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    _, made = timed(lambda: [make_trace(i, args.steps) for i in range(args.traces)])
    traces = [str(make_trace(i, args.steps)) for i in range(args.traces)]
    print(f"{args.traces} traces of ~{args.steps} steps ready in {made:.1f} s", file=sys.stderr)
    grid = parse_grid(GRID)
    tasks = plan(traces, grid, MODEL)
    per_trace = len(tasks) // len(traces)
    serial_n = min(args.serial_traces or len(traces), len(traces))
    serial_tasks = tasks[: serial_n * per_trace]

    rows: dict[str, tuple[float, bool, str]] = {}
    read_ms = reading_cost(traces[0])
    cpu = time.process_time()
    serial, t_serial = timed(lambda: run_sweep(serial_tasks, "serial", 1, progress("1 worker")))
    cpu = time.process_time() - cpu
    serial_steps = sum(r.metrics["num_steps"] for r in serial if r.metrics)
    reference = to_json(serial, "ttft_p99")
    scale = len(tasks) / len(serial_tasks)
    note = "" if scale == 1 else f"extrapolated from {len(serial_tasks)} tasks"
    rows["1 worker"] = (t_serial * scale, True, note)
    pool, t_pool = timed(lambda: run_sweep(tasks, "pool", args.jobs, progress("pool")))
    same = to_json(pool[: len(serial)], "ttft_p99") == reference
    rows[f"process pool x{args.jobs}"] = (t_pool, same, "")
    ray_start = ray_first = ray_trip = float("nan")
    if not args.no_ray:
        ray_rows, t_ray = timed(lambda: run_sweep(tasks, "ray", args.jobs, progress("ray")))
        rows[f"ray x{args.jobs} (local)"] = (
            t_ray,
            to_json(ray_rows, "ttft_p99") == to_json(pool, "ttft_p99")
            and to_json(ray_rows[: len(serial)], "ttft_p99") == reference,
            "cluster start included",
        )
        ray_start, ray_first, ray_trip = ray_overheads(args.jobs)
    errors = sum(r.error is not None for r in pool)

    n = len(tasks)
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    marked = sum(t.recorded for t in tasks)
    steps = sum(r.metrics["num_steps"] for r in pool if r.metrics)
    print(f"\n{len(traces)} traces x {per_trace} configs = {n} tasks ({marked} marked recorded)")
    print(f"traces of ~{args.steps} steps; the tasks simulated {steps:,} steps in all")
    print(
        f"errors: {errors}; 1 worker: mean task {t_serial / len(serial_tasks) * 1e3:.0f} ms, "
        f"{t_serial / serial_steps * 1e3:.3f} ms wall and {cpu / serial_steps * 1e3:.3f} ms CPU "
        "per simulated step (reading each trace once included)"
    )
    print(f"reading a trace: {read_ms:.3f} ms CPU per recorded step")
    print("\n| executor | wall s | tasks/s | vs 1 worker | same rows | note |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    base = rows["1 worker"][0]
    for name, (wall, ok, note) in rows.items():
        print(
            f"| {name} | {wall:.1f} | {n / wall:.2f} | {base / wall:.2f}x | "
            f"{'yes' if ok else 'NO'} | {note} |"
        )
    if not args.no_ray:
        print(
            f"\nray: local cluster start {ray_start:.2f} s; first empty task (a worker starts) "
            f"{ray_first * 1e3:.0f} ms; then one empty task {ray_trip * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
