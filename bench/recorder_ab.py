"""Recording cost before and after a change, in one process: a plain engine, a twin
recorded by another checkout's recorder (A, "before") and a twin recorded by this
checkout's (B), stepped in rotation (each order of the three in turn), as
bench/recorder_bench.py pairs its engines. On a machine shared with other work, separate
runs of the two checkouts drift by more than the difference; here the same disturbance
falls on all three engines.

    .venv/bin/python bench/recorder_ab.py --before /path/to/other/checkout [--steps 1500]

A is this checkout's engine and the other checkout's `recorder.recorder`,
`recorder.codec` and `engine.state` (loaded beside this checkout's under other names;
every other module is this checkout's): made for changes within those three files.
Prints each twin's step time against the plain engine's (median, and mean with
snapshots) and the recorder's own CPU time a step (on_step's, on the thread's CPU clock;
the clock's cost falls on both twins alike). The flush timer's thread is not counted."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import recorder.recorder as this_recorder  # noqa: E402
from bench.recorder_bench import warm_up, workload  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.records import Step  # noqa: E402
from engine.sim.driver import make_engine  # noqa: E402

# Each order of the three engines in turn: none gains from always following another.
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 0, 2))


def load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Clocked:
    """The recorder as the engine's sink, its on_step's CPU time counted."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.cpu_ns: list[int] = []

    def on_step(self, report: Step) -> None:
        t = time.thread_time_ns()
        self.recorder.on_step(report)
        self.cpu_ns.append(time.thread_time_ns() - t)

    def close(self) -> None:
        self.recorder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--steps", type=int, default=1500, help="timed steps per engine")
    args = parser.parse_args()
    before = args.before.resolve()
    codec = load("before_codec", before / "recorder" / "codec.py")
    old = load("before_recorder", before / "recorder" / "recorder.py")
    state = load("before_state", before / "engine" / "state.py")
    old.encode_steady, old.encode = codec.encode_steady, codec.encode  # type: ignore[attr-defined]
    w = workload(args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="recorder-ab-"))
    engines: list[EngineCore] = [make_engine(w) for _ in range(3)]
    a, b = engines[1], engines[2]
    a.snapshot = lambda: state.snapshot(a.scheduler)  # type: ignore[method-assign]
    sinks = [
        Clocked(old.open_recording(a, tmp / "a.trace")),
        Clocked(this_recorder.open_recording(b, tmp / "b.trace")),
    ]
    a.sink, b.sink = sinks
    runs = [warm_up(w, e) for e in engines]
    for s in sinks:
        s.cpu_ns.clear()
    wall: list[list[int]] = [[], [], []]
    for i in range(args.steps):
        for k in ORDERS[i % len(ORDERS)]:
            t = time.perf_counter_ns()
            next(runs[k])
            wall[k].append(time.perf_counter_ns() - t)
    for e in engines:
        e.close()
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    median = [statistics.median(x) for x in wall]
    mean = [statistics.mean(x) for x in wall]
    print(f"recorder A/B: A = {before}, B = this checkout; {args.steps} steps each, rotated")
    print("                      median step        mean step (with snapshots)   recorder CPU/step")
    print(f"  plain engine     {median[0] / 1e3:8.0f} us          {mean[0] / 1e3:8.0f} us")
    for k, name in ((1, "A (before)"), (2, "B (after) ")):
        cpu = [t / 1e3 for t in sinks[k - 1].cpu_ns]
        print(
            f"  {name}      {median[k] / median[0] - 1:+8.1%}            "
            f"{mean[k] / mean[0] - 1:+8.1%}                "
            f"median {statistics.median(cpu):5.1f} us, mean {statistics.mean(cpu):5.1f} us"
        )


if __name__ == "__main__":
    main()
