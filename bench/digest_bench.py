"""What the TUI's per-step bookkeeping costs, this checkout against another (issue 27
item 4 added prefix-cache hits, misses and evictions to every step's digest, and shared
prefix tracking to the incidents view's queue scan):

1. digest: History.fill over every step of a trace (the event log and sparklines' input),
   CPU µs per step;
2. queue scan: QueueScan.advance over every step (the incidents view's waits, and now its
   prefix-cache losses), CPU µs per step;
3. incident scan: IncidentScan.advance over every step (the incidents view's list; since
   issue 23 both scans walk the frames through replays.scan.RecordScan), CPU µs per step.

    .venv/bin/python bench/digest_bench.py --baseline ../main [TRACE ...]

Each side runs in its own interpreter with its checkout first on sys.path; the best of
`--repeat` runs is kept (the machine is shared), and the table gives both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = [
    ROOT / "replays" / "incidents" / "preemption_storm.trace",
    ROOT / "replays" / "incidents" / "prefix_thrash.trace",
]


def measure(trace: str, repeat: int) -> dict[str, float]:
    """CPU µs per step of each part, best of `repeat` (run inside one checkout)."""
    from recorder.reader import TraceReader
    from replays.queueing import QueueScan
    from replays.storms import IncidentScan
    from replays.timeline import Timeline
    from tui.history import History

    best = {"digest": float("inf"), "queue scan": float("inf"), "incident scan": float("inf")}
    for _ in range(repeat):
        with TraceReader(trace) as reader:
            tl = Timeline(reader)
            h = History(capacity=1 << 20)
            if hasattr(h, "prefix_caching"):
                h.prefix_caching = True
            t = time.process_time()
            h.fill(tl, tl.first_step, tl.last_step)
            steps = tl.last_step - tl.first_step + 1
            best["digest"] = min(best["digest"], (time.process_time() - t) / steps * 1e6)
        with TraceReader(trace) as reader:
            q = QueueScan(reader)
            t = time.process_time()
            n = q.advance()
            best["queue scan"] = min(best["queue scan"], (time.process_time() - t) / n * 1e6)
        with TraceReader(trace) as reader:
            s = IncidentScan(reader)
            t = time.process_time()
            n = s.advance()
            best["incident scan"] = min(best["incident scan"], (time.process_time() - t) / n * 1e6)
    return best


def side(checkout: Path, traces: list[str], repeat: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--repeat", str(repeat)]
    out = subprocess.run([*cmd, *traces], env=env, capture_output=True, text=True, check=True)
    result: dict[str, dict[str, float]] = json.loads(out.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", default=[str(p) for p in DEFAULT])
    ap.add_argument("--baseline", required=False, help="the other checkout (e.g. main)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps({t: measure(t, args.repeat) for t in args.traces}))
        return
    ours = side(ROOT, args.traces, args.repeat)
    base = side(Path(args.baseline), args.traces, args.repeat) if args.baseline else None
    print("| trace | part | baseline µs/step | this µs/step | this / baseline |")
    print("| --- | --- | ---: | ---: | ---: |")
    for t in args.traces:
        for part, v in ours[t].items():
            b = base[t][part] if base else None
            ratio = f"{v / b:.2f}" if b else "-"
            shown = f"{b:.1f}" if b is not None else "-"
            print(f"| {Path(t).name} | {part} | {shown} | {v:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
