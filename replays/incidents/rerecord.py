"""Re-record the incident traces from their workloads, after a deliberate change of the
scheduler's behaviour:

    .venv/bin/python -m replays.incidents.rerecord

Each `NAME.workload.json` here becomes `NAME.trace` (a new recording with `schedtop sim`,
run as a separate process: replays does not drive the engine itself). The regression
tests (tests/test_incidents.py) re-simulate each trace and diff the result against it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rerecord() -> list[Path]:
    written = []
    for workload in sorted(HERE.glob("*.workload.json")):
        trace = HERE / workload.name.replace(".workload.json", ".trace")
        subprocess.run(
            [sys.executable, "-m", "tui.cli", "sim", str(workload), "--trace", str(trace)],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        written.append(trace)
    return written


if __name__ == "__main__":
    for path in rerecord():
        print(path)
