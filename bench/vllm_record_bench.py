"""What recording costs inside vLLM: RecordingScheduler against vLLM's plain scheduler.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_record_bench.py [--steps 200] [--repeats 5]
        [--running 256 1024] [--no-churn]

Runs in an interpreter that has vLLM (no model: a tiny config.json stands in, as in
replays/vllm_driver.py). For 256 and 1024 running requests in steady decoding, sync and
async scheduler, it measures the CPU time of schedule() + update_from_output() per step
for vLLM's own scheduler and for the recording one, stepping the two in turn (so that a
busy machine weighs on both alike), with the heap frozen as vLLM freezes it once it
has started: the overhead over all steps ("best": the round with the least, "median":
the median round), the CPU of the recorder's own threads apart ("threads": encoding and
appending the records, writing the file) and with them ("all"), and the trace bytes per step
(snapshots included). Targets (issue 12): the recorder adds at most
3% to vLLM's own schedule + update time, and a step of 256 running requests costs at
most 2 KiB of trace.

Steady decoding is the issue's definition, and the recorder's best case: no request
arrives or finishes. A server always has some; the "churn" rows measure that too: the
requests' lengths are staggered so that about one finishes each step, and a new one (an
8-token prompt) arrives for each that finished, so the running batch stays full and the
scheduler admits a request every step.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from statistics import median
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from recorder.vllm import RecordingScheduler  # noqa: E402
from replays.vllm_driver import vllm_configs  # noqa: E402

BLOCK_SIZE = 16


class Bench:
    """One scheduler with `n` requests decoding, stepped like vLLM's engine core."""

    def __init__(
        self,
        n: int,
        is_async: bool,
        recording: bool,
        trace: Path | None,
        steps: int,
        churn: bool = False,
    ) -> None:
        self.n, self.churn, self.next_id = n, churn, n
        # Room for every request's whole run: a full pool would preempt and shrink the batch.
        length = 2 * n + 64 if churn else steps
        blocks_each = (8 + length + 2 * BLOCK_SIZE) // BLOCK_SIZE + 1
        cfg = EngineConfig(
            block_size=BLOCK_SIZE,
            num_blocks=n * blocks_each + 64,
            max_num_batched_tokens=max(2048, n),
            max_num_seqs=n,
            max_model_len=8 + length + 4 * BLOCK_SIZE,
            async_scheduling=is_async,
        )
        vllm_config, kv = vllm_configs(cfg)
        kwargs: dict[str, Any] = dict(
            vllm_config=vllm_config,
            kv_cache_config=kv,
            block_size=BLOCK_SIZE,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
        if recording:
            assert trace is not None
            os.environ["SCHEDTOP_TRACE_FILE"] = str(trace)
            self.sched = RecordingScheduler(**kwargs)
            del os.environ["SCHEDTOP_TRACE_FILE"]
        else:
            self.sched = (AsyncScheduler if is_async else Scheduler)(**kwargs)
        self.trace = trace
        self.is_async = is_async
        self.rng = random.Random(0)
        self.queue: list[tuple[Any, Any]] = []
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        for i in range(n):
            # Churn: the first requests finish one a step from step 32 on, and later
            # ones after 2n tokens, by when the first n have all been replaced.
            self.add(f"req-{i}", 32 + i if churn else 100_000)

    def add(self, rid: str, max_tokens: int) -> None:
        self.sched.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=[self.rng.randrange(32000) for _ in range(8)],
                sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                pooling_params=None,
                arrival_time=float(self.next_id),
                block_hasher=self.hasher,
            )
        )

    def refill(self) -> float:
        """Churn: a new request for each that finished (CPU seconds of add_request, which
        the recorder taps too)."""
        sched, spent = self.sched, 0.0
        while len(sched.running) + len(sched.waiting) < self.n:
            self.next_id += 1
            t0 = time.thread_time()
            self.add(f"new-{self.next_id}", 2 * self.n)
            spent += time.thread_time() - t0
        return spent

    def _output(self, out: Any) -> Any:
        ids = list(out.num_scheduled_tokens)
        toks = [
            [] if self.sched.requests[r].is_prefill_chunk else [self.rng.randrange(32000)]
            for r in ids
        ]
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=toks
        )

    def step(self) -> float:
        """One engine-core step; the CPU seconds this thread spent in schedule() and
        update (CPU time, not wall time: the machine may be shared)."""
        clock = time.thread_time
        spent = self.refill() if self.churn else 0.0
        t0 = clock()
        out = self.sched.schedule()
        t1 = clock()
        mro = self._output(out)
        if not self.is_async:
            t2 = clock()
            self.sched.update_from_output(out, mro)
            return spent + (t1 - t0) + (clock() - t2)
        self.queue.append((out, mro))
        if len(self.queue) < 2:
            return spent + t1 - t0
        old, old_mro = self.queue.pop(0)
        t2 = clock()
        self.sched.update_from_output(old, old_mro)
        return spent + (t1 - t0) + (clock() - t2)

    def writer_cpu(self) -> float:
        """CPU seconds the recorder's own threads have used (0 without them): the one that
        encodes and appends the records, and the trace writer's, which writes the file."""
        tap = getattr(self.sched, "_schedtop", None)
        threads = (
            getattr(getattr(tap, "recorder", None), "background_thread", None),
            getattr(getattr(tap, "writer", None), "_thread", None),
        )
        return sum(
            time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            for t in threads
            if t is not None and t.ident is not None and t.is_alive()
        )

    def trace_bytes(self) -> int:
        """The trace's bytes so far (every record recorded so far appended)."""
        tap = getattr(self.sched, "_schedtop", None)
        if tap is None or tap.writer is None:
            return 0
        if tap.recorder is not None:
            tap.recorder.drain()
        return int(tap.writer.offset)


def measure(
    n: int, is_async: bool, steps: int, repeats: int, tmp: Path, churn: bool = False
) -> dict[str, float]:
    warmup = 64 + n if churn else 20  # churn: until the first requests are all replaced
    total = warmup + steps * repeats
    plain = Bench(n, is_async, False, None, total, churn)
    rec = Bench(n, is_async, True, tmp / f"bench-{n}-{is_async}-{churn}.trace", total, churn)
    for b in (plain, rec):
        for _ in range(warmup):  # admit everyone (prefill), reach steady decoding
            b.step()
    # As vLLM's engine core does once it has started (vllm.utils.gc_utils.freeze_gc_heap):
    # a full collection of the two schedulers' heaps would otherwise land, 0.4 s at a
    # time, on whichever step the collector happens to pick.
    gc.collect()
    gc.freeze()
    plain_t: list[float] = []
    rec_t: list[float] = []
    start = rec.trace_bytes()
    writer0 = rec.writer_cpu()
    for _ in range(repeats):
        # Step by step in turn, so that both see the same machine (it may be shared).
        tp = tr = 0.0
        for _ in range(steps):
            tp += plain.step()
            tr += rec.step()
        plain_t.append(tp / steps)
        rec_t.append(tr / steps)
    bytes_end = rec.trace_bytes()
    writer_s = (rec.writer_cpu() - writer0) / (steps * repeats)
    plain_us, rec_us = sum(plain_t) / repeats, sum(rec_t) / repeats
    ratios = [r / p for r, p in zip(rec_t, plain_t)]
    # Over every measured step: the snapshot every 256 steps is amortized, as in a trace.
    bytes_per_step = (bytes_end - start) / (steps * repeats)
    rec.sched.shutdown()
    gc.unfreeze()
    for b in (plain, rec):  # every request still decoding: the batch never shrank
        if not churn:
            assert len(b.sched.running) == n and not b.sched.waiting, "the pool ran out"
        assert all(r.num_preemptions == 0 for r in b.sched.requests.values()), "preempted"
    return {
        "plain_us": plain_us * 1e6,
        "rec_us": rec_us * 1e6,
        "overhead": rec_us / plain_us - 1,
        "best": min(ratios) - 1,
        "median": median(ratios) - 1,
        # The recorder's threads (they encode the records and write the file), as a share
        # of vLLM's own schedule + update time: the engine's process pays them too.
        "writer": writer_s / plain_us,
        "all": (rec_us + writer_s) / plain_us - 1,
        "bytes": bytes_per_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--no-churn", action="store_true", help="steady decoding only (no churn rows)")
    args = ap.parse_args()
    import vllm

    print(
        f"vLLM {vllm.__version__}; {args.steps} decode steps per round, {args.repeats} rounds "
        "step by step in turn; CPU time of schedule() + update_from_output() per step"
    )
    print(
        f"{'running':>8} {'load':>7} {'scheduler':>15} {'vLLM us/step':>13} {'recording':>10} "
        f"{'overhead':>9} {'best':>7} {'median':>7} {'threads':>8} {'all':>7} {'bytes/step':>11}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for churn in (False,) if args.no_churn else (False, True):
            for n in args.running:
                for is_async in (False, True):
                    r = measure(n, is_async, args.steps, args.repeats, Path(tmp), churn)
                    name = "AsyncScheduler" if is_async else "Scheduler"
                    load = "churn" if churn else "steady"
                    print(
                        f"{n:>8} {load:>7} {name:>15} {r['plain_us']:>13.0f} {r['rec_us']:>10.0f} "
                        f"{r['overhead']:>+9.1%} {r['best']:>+7.1%} {r['median']:>+7.1%} "
                        f"{r['writer']:>+8.1%} {r['all']:>+7.1%} {r['bytes']:>11.0f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
