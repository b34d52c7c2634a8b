"""What a server's flight recorder costs the engine thread: time spent recording per step
with rotating segments and live viewers, side by side with the plain Recorder writing one
file (the peer), for the simulated engine with 256 requests decoding.

    .venv/bin/python bench/stream_bench.py [--steps 1024] [--runs 3]

Each configuration runs the same workload; the time measured is the engine sink's own
(around on_step: converting, encoding, writing, fanning out, rotating), not the simulated
model's; the first 16 steps (256 arrivals with their prompts) are left out. Viewers:
`fast` ones are read by threads as the records come; `stuck` ones are never read (their
queues, 256 KiB here, fill up and, having read nothing, they are dropped). Rotation: a
4 MiB bound makes 512 KiB segments, each opening with a snapshot (here about 600 KiB: every
cached block's hash), which the engine thread takes like a periodic one."""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.core import EngineCore  # noqa: E402
from engine.records import Step  # noqa: E402
from engine.sim.driver import make_engine, run_steps  # noqa: E402
from engine.sim.workload import SimWorkload, parse_workload  # noqa: E402
from recorder.recorder import Recorder  # noqa: E402
from recorder.segments import list_segments  # noqa: E402
from recorder.serving import ServerRecording  # noqa: E402
from recorder.stream import StreamSubscription  # noqa: E402
from recorder.writer import TraceWriter  # noqa: E402

RUNNING = 256
VOCAB = 49152


def workload(steps: int) -> SimWorkload:
    """256 requests sharing a system prompt, all decoding for longer than the run."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(64)]
    out = steps + 64
    requests = [
        dict(
            id=f"req-{i:04d}",
            arrival_step=0,
            prompt_token_ids=system + [rng.randrange(VOCAB) for _ in range(8 + i % 48)],
            output_token_ids=[rng.randrange(VOCAB) for _ in range(out)],
            max_tokens=out,
        )
        for i in range(RUNNING)
    ]
    config = dict(
        block_size=16,
        num_blocks=RUNNING * ((64 + 56 + out) // 16 + 2) + 1,
        max_num_batched_tokens=8192,
        max_num_seqs=RUNNING,
        max_model_len=8192,
    )
    return parse_workload({"config": config, "requests": requests}, source="stream-bench")


class Timed:
    """The engine's sink, timed: seconds spent in on_step, per step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.times: list[float] = []

    def on_step(self, report: Step) -> None:
        t0 = time.perf_counter()
        self.inner.on_step(report)
        self.times.append(time.perf_counter() - t0)

    def on_client(self, report: Any) -> None:
        self.inner.on_client(report)

    def close(self) -> None:
        self.inner.close()


def run(
    name: str, steps: int, attach: Callable[[EngineCore, Path], tuple[Any, list[Any]]]
) -> dict[str, Any]:
    w = workload(steps)
    engine = make_engine(w)
    with tempfile.TemporaryDirectory() as tmp:
        rec, viewers = attach(engine, Path(tmp))
        timed = Timed(engine.sink)
        engine.sink = timed
        it = run_steps(w, engine)
        peak = 0  # the most bytes any viewer had queued after a step
        for _ in range(steps):
            next(it)
            peak = max([peak] + [v.buffered for v in viewers])
        rec.close()
        run_dir = Path(tmp) / "run"
        segments = len(list_segments(run_dir)) if run_dir.exists() else 1
        rotations = getattr(rec, "_seq", 1) - 1
        skips = sum(getattr(v, "skips", 0) for v in viewers)
        dropped = sum(bool(getattr(v, "dropped", False)) for v in viewers)
        for v in viewers:
            v.close()
    times = timed.times[16:]
    return dict(
        name=name,
        median_us=statistics.median(times) * 1e6,
        mean_us=statistics.fmean(times) * 1e6,
        p99_us=sorted(times)[int(len(times) * 0.99)] * 1e6,
        segments=segments,
        rotations=rotations,
        skips=skips,
        dropped=dropped,
        peak=peak,
    )


def plain(engine: EngineCore, tmp: Path) -> tuple[Any, list[Any]]:
    return Recorder(engine, TraceWriter(tmp / "one.trace", live=False, flush_interval_s=0.1)), []


def server(
    max_bytes: int = 2 << 30, fast: int = 0, stuck: int = 0, limit: int = 4 << 20
) -> Callable[..., Any]:
    def attach(engine: EngineCore, tmp: Path) -> tuple[Any, list[Any]]:
        rec = ServerRecording(engine, tmp / "run", max_bytes=max_bytes, stream_limit=limit)
        viewers: list[Any] = [rec.subscribe() for _ in range(fast + stuck)]
        rec.on_idle()  # they get their header (step 0: no snapshot yet)
        for sub in viewers[:fast]:
            threading.Thread(target=_read, args=(sub,), daemon=True).start()
        return rec, viewers

    return attach


def _read(sub: StreamSubscription) -> None:
    while sub.get(0.5) != b"":
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3, help="best of this many per configuration")
    args = ap.parse_args()
    configs: list[tuple[str, Callable[..., Any]]] = [
        ("Recorder, one file (peer)", plain),
        ("ServerRecording, no viewer", server()),
        ("+ 4 fast viewers", server(fast=4)),
        ("+ 4 stuck viewers", server(stuck=4, limit=256 << 10)),
        ("4 MiB bound (rotating)", server(max_bytes=4 << 20)),
        ("4 MiB bound + 4 fast", server(max_bytes=4 << 20, fast=4)),
    ]
    rows = []
    for name, attach in configs:
        best = min((run(name, args.steps, attach) for _ in range(args.runs)), key=_median)
        rows.append(best)
    base = rows[0]["median_us"]  # medians: means swing with the machine's other load
    print(f"{RUNNING} requests decoding, {args.steps} steps, best of {args.runs}; {_machine()}")
    print(
        f"{'':<28} {'median us':>10} {'mean us':>9} {'p99 us':>9} {'median vs peer':>14} "
        f"{'rotations':>9} {'kept':>4} {'skips':>5} {'dropped':>7} {'peak queued':>11}"
    )
    for r in rows:
        print(
            f"{r['name']:<28} {r['median_us']:>10.0f} {r['mean_us']:>9.0f} {r['p99_us']:>9.0f} "
            f"{r['median_us'] / base:>13.2f}x {r['rotations']:>9} {r['segments']:>4} "
            f"{r['skips']:>5} {r['dropped']:>7} {r['peak']:>11,}"
        )


def _median(row: dict[str, Any]) -> float:
    return float(row["median_us"])


def _machine() -> str:
    return f"{platform.machine()}, Python {platform.python_version()}"


if __name__ == "__main__":
    main()
