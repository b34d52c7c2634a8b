"""Replay at scale: a trace of 1,000,000 steps with 256 running requests, opened, seeked,
stepped back, and re-simulated.

    .venv/bin/python bench/replay_bench.py [--steps 1000000] [--trace PATH] [--resim-steps 20000]

The trace is generated once with the simulated engine (25-40 minutes here, 5.6 GiB) and cached
at /tmp/schedtop-bench/1m-256.trace (the TUI benchmark uses it too). Requests are made on
the fly, so that about 256 are always running: each arrives with a 64-192 token prompt,
decodes 200-600 tokens, and is replaced when it finishes.

It reports: open time (reader + Timeline), random seek time p50/p99 (state at a random
step, from the nearest keyframe or snapshot), step-back time (state at i-1 after state at
i), both also as the seeking thread's CPU time (on a shared machine the wall clock
includes other processes' share of the cores), peak memory (the process's max RSS while
replaying), and re-simulation speed next to the simulated engine's own speed on the same
steps (alternated runs, medians)."""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.kv.hashing import BlockHasher  # noqa: E402
from engine.records import percentile  # noqa: E402
from engine.request import Request, SamplingParams  # noqa: E402
from engine.sim.runner import SimRunner  # noqa: E402
from recorder.reader import TraceReader  # noqa: E402
from recorder.recorder import Recorder, RecorderOptions  # noqa: E402
from recorder.writer import TraceWriter  # noqa: E402
from replays.resim import resimulate  # noqa: E402
from replays.timeline import Timeline  # noqa: E402

DEFAULT_TRACE = Path("/tmp/schedtop-bench/1m-256.trace")
RUNNING = 256
VOCAB = 49152


class _Script:
    """A request's sampled tokens, made up on demand (a million requests' worth of
    scripts would not fit in memory)."""

    __slots__ = ("seed", "length")

    def __init__(self, seed: int, length: int) -> None:
        self.seed = seed
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        return (self.seed * 2654435761 + i * 40503) % VOCAB


class _Scripts(dict[str, _Script]):
    """Scripts that forget a request once it is gone (the runner never asks again)."""


def config() -> EngineConfig:
    per_request = (192 + 600) // 16 + 2
    return EngineConfig(
        block_size=16,
        num_blocks=RUNNING * per_request * 5 // 4,
        max_num_batched_tokens=8192,
        max_num_seqs=RUNNING,
        max_model_len=2048,
    )


class Workload:
    """Keeps about RUNNING requests in the engine, replacing each one that finishes."""

    def __init__(self, engine: EngineCore, runner: SimRunner, seed: int = 0) -> None:
        self.engine = engine
        self.runner = runner
        self.rng = random.Random(seed)
        self.hasher = BlockHasher(engine.config.block_size)
        self.next_id = 0
        self.live = 0

    def top_up(self) -> None:
        for req in self.engine.take_finished():
            self.runner.scripts.pop(req.request_id, None)
            self.live -= 1
        while self.live < RUNNING:
            self._add()

    def _add(self) -> None:
        i = self.next_id
        self.next_id += 1
        rid = f"r{i}"
        n_out = self.rng.randint(200, 600)
        self.runner.scripts[rid] = _Script(zlib.crc32(rid.encode()), n_out)  # type: ignore[assignment]
        prompt = [(i * 7919 + j * 104729) % VOCAB for j in range(self.rng.randint(64, 192))]
        self.engine.add_request(
            Request(
                rid,
                prompt,
                SamplingParams(max_tokens=n_out),
                arrival_time=float(i),
                block_hasher=self.hasher,
            )
        )
        self.live += 1


def steps(engine: EngineCore, wl: Workload, n: int) -> Iterator[None]:
    for _ in range(n):
        wl.top_up()
        engine.step()
        yield


def generate(
    path: Path, n: int, snapshot_interval: int = 256, snapshot_work: int | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    runner = SimRunner(_Scripts())
    engine = EngineCore(config(), runner)
    recorder = Recorder(
        engine,
        TraceWriter(tmp, live=False),
        RecorderOptions(snapshot_interval=snapshot_interval, snapshot_work=snapshot_work),
    )
    wl = Workload(engine, runner)
    t0 = time.perf_counter()
    for i, _ in enumerate(steps(engine, wl, n)):
        if i and i % 50_000 == 0:
            rate = i / (time.perf_counter() - t0)
            print(f"  generated {i:,} steps ({rate:,.0f} steps/s)", flush=True)
    recorder.close()
    tmp.rename(path)


def sim_speed(n: int) -> float:
    """Steps per second of the simulated engine alone over the first n steps."""
    runner = SimRunner(_Scripts())
    engine = EngineCore(config(), runner)
    wl = Workload(engine, runner)
    t0 = time.perf_counter()
    for _ in steps(engine, wl, n):
        pass
    return n / (time.perf_counter() - t0)


def resim_speed(path: Path, n: int) -> float:
    """Steps per second of a faithful re-simulation of the first n steps of `path`."""
    t0 = time.perf_counter()
    result = resimulate(path, max_steps=n)
    assert result.reproduced, result.divergence
    return result.num_steps / (time.perf_counter() - t0)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--seeks", type=int, default=200)
    ap.add_argument("--resim-steps", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--snapshot-interval",
        type=int,
        default=256,
        help="steps between snapshots when generating, at most",
    )
    ap.add_argument(
        "--snapshot-work",
        type=int,
        default=None,
        help="replay work between snapshots when generating (default: the recorder's, "
        "for this pool; 0: by step count only): the seek-cost lever",
    )
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"generating {args.steps:,} steps into {args.trace} ...", flush=True)
        generate(args.trace, args.steps, args.snapshot_interval, args.snapshot_work)
    size = args.trace.stat().st_size
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    t0 = time.perf_counter()
    reader = TraceReader(args.trace)
    tl = Timeline(reader)
    open_s = time.perf_counter() - t0
    snaps = reader.index().snapshot_steps

    rng = random.Random(7)
    seeks, seek_cpu = [], []
    for _ in range(args.seeks):
        step = rng.randrange(tl.num_steps)
        t, c = time.perf_counter(), time.thread_time()
        tl.state(step)
        seek_cpu.append(time.thread_time() - c)
        seeks.append(time.perf_counter() - t)
    backs, back_cpu = [], []
    for _ in range(20):
        step = rng.randrange(100, tl.num_steps)
        tl.state(step)
        for s in range(step - 1, step - 31, -1):
            t, c = time.perf_counter(), time.thread_time()
            tl.state(s)
            back_cpu.append(time.thread_time() - c)
            backs.append(time.perf_counter() - t)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reader.close()

    sims, resims = [], []
    for _ in range(args.repeats):
        sims.append(sim_speed(args.resim_steps))
        resims.append(resim_speed(args.trace, args.resim_steps))
    sim_rate, resim_rate = statistics.median(sims), statistics.median(resims)

    def p99(values: list[float]) -> float:  # the one percentile (engine.records)
        return percentile(values, 99) or 0.0

    print(
        f"trace: {args.trace} ({tl.num_steps:,} steps, {RUNNING} running, {size / 2**30:.2f} GiB, "
        f"{size / tl.num_steps / 1024:.1f} KiB/step; {len(snaps):,} snapshots, one every "
        f"{tl.num_steps / max(1, len(snaps)):.0f} steps; snapshot_work {tl.header.snapshot_work})"
    )
    print(f"{'measure':<34} {'result':>14} {'target':>12}")
    print(f"{'open (reader + timeline)':<34} {ms(open_s):>14} {'< 1 s':>12}")
    print(f"{'random seek p50':<34} {ms(statistics.median(seeks)):>14}")
    print(f"{'random seek p99':<34} {ms(p99(seeks)):>14} {'< 50 ms':>12}")
    # CPU time of the seeking thread: what the seek costs without the other processes'
    # share of the cores (the wall-clock figures above include it).
    print(f"{'random seek p50, CPU time':<34} {ms(statistics.median(seek_cpu)):>14}")
    print(f"{'random seek p99, CPU time':<34} {ms(p99(seek_cpu)):>14}")
    print(f"{'step back p50':<34} {ms(statistics.median(backs)):>14}")
    print(f"{'step back p99':<34} {ms(p99(backs)):>14} {'< 5 ms':>12}")
    print(f"{'step back p99, CPU time':<34} {ms(p99(back_cpu)):>14}")
    print(
        f"{'peak memory (max RSS)':<34} {rss / 1024:>11.0f} MB {'< 500 MB':>12}"
        f"   (before opening: {rss0 / 1024:.0f} MB)"
    )
    print(f"{'simulated engine':<34} {sim_rate:>9,.0f} st/s")
    print(
        f"{'re-simulation':<34} {resim_rate:>9,.0f} st/s "
        f"{resim_rate / sim_rate:>10.0%}  (target >= 80%)"
    )


if __name__ == "__main__":
    main()
