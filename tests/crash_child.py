"""The recording process the crash test kills: a long simulated run, recorded, printing
after every step the last step a reader can already see.

    python -m tests.crash_child PATH MODE      MODE: live | batch | torn

`torn` writes each flush in 61-byte pieces on a slow disk, so that a kill often lands
inside a record, as after a short write."""

from __future__ import annotations

import os
import random
import sys
import time

from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload, parse_workload
from recorder.recorder import Recorder, RecorderOptions
from recorder.writer import TraceWriter


def long_workload(num_requests: int = 64, seed: int = 7) -> SimWorkload:
    """Shared prefixes, long outputs and a tight pool: prefix hits and preemptions."""
    rng = random.Random(seed)
    system = list(range(5000, 5064))
    requests = []
    for i in range(num_requests):
        own = [rng.randrange(1, 30000) for _ in range(rng.randint(8, 120))]
        prompt = (system if i % 3 else []) + own
        out = rng.randint(100, 700)
        requests.append(
            dict(
                id=f"req-{i:03d}",
                arrival_step=i * 6,
                prompt_token_ids=prompt,
                output_token_ids=[rng.randrange(1, 30000) for _ in range(out)],
                max_tokens=out,
                priority=i % 4,
            )
        )
    config = dict(
        block_size=16,
        num_blocks=400,
        max_num_batched_tokens=256,
        max_num_seqs=24,
        long_prefill_token_threshold=96,
        max_model_len=4096,
    )
    return parse_workload({"config": config, "requests": requests}, source="crash")


def _torn_write(fd: int, data: memoryview) -> int:
    time.sleep(0.0002)
    return os.write(fd, data[:61])


def main(path: str, mode: str) -> None:
    w = long_workload()
    engine = make_engine(w)
    writer = TraceWriter(
        path,
        live=mode != "batch",
        flush_bytes=4096,
        flush_interval_s=0.01,
        write=_torn_write if mode == "torn" else os.write,
    )
    recorder = Recorder(engine, writer, RecorderOptions(snapshot_interval=32, strict=True))
    for _ in run_steps(w, engine):
        print(recorder.flushed_step, flush=True)
    engine.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
