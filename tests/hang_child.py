"""An engine process that hangs: the flight recorder's hang-and-kill test runs it, waits
until it says it hung, and SIGKILLs it (issue 25, item 1).

    python -m tests.hang_child run|serve PATH STEPS

Records the crash test's long simulated run as `schedtop run` records (open_recording)
or as `schedtop serve` does (a ServerRecording into the run directory PATH), steps
STEPS times, writes the last step it recorded to PATH.hung, then stops stepping for good
(a hung model call, say): no step, no idle call, nothing on the engine's thread writes
the trace any more. Only the recorder's flush timer can."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from engine.sim.driver import make_engine, run_steps
from recorder.recorder import open_recording
from recorder.serving import ServerRecording
from tests.crash_child import long_workload


def main(mode: str, path: str, steps: str) -> None:
    w = long_workload()
    engine = make_engine(w)
    if mode == "serve":
        ServerRecording(engine, Path(path), snapshot_interval=32)
    else:
        open_recording(engine, path, snapshot_interval=32)
    last = -1
    for result in run_steps(w, engine):
        last = result.report.step
        if last + 1 >= int(steps):
            break
    Path(path + ".hung").write_text(str(last))
    while True:  # hung: the engine's thread never returns
        time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
