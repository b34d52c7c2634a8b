"""The server-style recording process the segment crash test kills: the crash test's long
simulated run under a ServerRecording with small segments, printing after every step the
last step a reader of the directory can already see.

    python -m tests.segments_child DIRECTORY MAX_BYTES"""

from __future__ import annotations

import sys
from pathlib import Path

from engine.sim.driver import make_engine, run_steps
from recorder.serving import ServerRecording
from tests.crash_child import long_workload


def main(directory: str, max_bytes: str) -> None:
    w = long_workload()
    engine = make_engine(w)
    rec = ServerRecording(engine, Path(directory), max_bytes=int(max_bytes), snapshot_interval=32)
    for i, _ in enumerate(run_steps(w, engine)):
        if i % 7 == 0:
            rec.on_idle()  # a server's engine thread calls it whenever it waits
        print(rec.flushed_step, flush=True)
    rec.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
