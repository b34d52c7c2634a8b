"""Runs in vLLM's venv (tests/test_vllm_kv_deferred.py): the benchmark's churn load
recorded twice, with the KV operations run on the encoding thread (as recorded) and at
each step's end on vLLM's engine thread (kv_inline); prints both traces' records, less
their timings, and whether operations were left for the encoding thread.

    python -m tests.vllm_kv_deferred sync|async RUNNING STEPS OUT.pickle
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

from recorder.reader import TraceReader

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = {"time_ns": 0, "schedule_ns": 0, "update_ns": 0, "work_ns": 0}


def bench_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_record_bench", ROOT / "bench/vllm_record_bench.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(bench: Any, is_async: bool, n: int, steps: int, inline: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.trace"
        b = bench.Bench(n, is_async, True, trace, steps, churn=True)
        tap = b.sched._schedtop
        tap.kv_inline = inline
        left = 0  # steps that ended with operations not run yet
        for _ in range(steps):
            b.step()
            left += bool(tap.ops)
        b.close()
        records = []
        with TraceReader(trace) as reader:
            for entry in reader.entries():
                rec = entry.record
                if type(rec).__name__ in ("Header", "Footer", "End"):
                    continue
                if type(rec).__name__ == "Step":
                    rec = dataclasses.replace(rec, **TIMINGS)
                records.append(rec)
    return {"records": records, "left": left, "stopped": tap.stopped}


def main() -> None:
    mode, n, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    bench = bench_module()
    runs = {inline: record(bench, mode == "async", n, steps, inline) for inline in (False, True)}
    Path(out).write_bytes(pickle.dumps({"deferred": runs[False], "inline": runs[True]}))


if __name__ == "__main__":
    main()
