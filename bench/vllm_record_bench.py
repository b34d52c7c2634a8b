"""What recording costs inside vLLM: RecordingScheduler against vLLM's plain scheduler.

    PYTHONPATH=. .venv-vllm/bin/python bench/vllm_record_bench.py [--steps 200] [--repeats 5]
        [--running 256 1024] [--no-churn] [--load steady churn] [--scheduler sync async]

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
import socket
import subprocess
import sys
import tempfile
import threading
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
        live: str = "",
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
        self.viewer: subprocess.Popen[bytes] | None = None
        if recording and live:
            # The live port (recorder.vllm.live): segments in a directory, the HTTP
            # side on a port of its own, the scheduler's calls under its lock.
            assert trace is not None
            port = free_port()
            env = {"SCHEDTOP_TRACE_DIR": str(trace), "SCHEDTOP_LIVE_PORT": str(port)}
            os.environ.update(env)
            try:
                self.sched = RecordingScheduler(**kwargs)
            finally:
                for k in env:
                    del os.environ[k]
            if live == "viewer":
                self.viewer = start_viewer(port)
        elif recording:
            assert trace is not None
            os.environ["SCHEDTOP_TRACE_FILE"] = str(trace)
            self.sched = RecordingScheduler(**kwargs)
            del os.environ["SCHEDTOP_TRACE_FILE"]
        else:
            self.sched = (AsyncScheduler if is_async else Scheduler)(**kwargs)
        self.trace = trace
        self.live = live
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
        encodes and appends the records, and the trace writer's, which writes the file;
        with a live port, the HTTP side's too (a viewer's connection writes the stream).
        The live recording's current segment only: each segment has threads of its own,
        and the benchmark's runs are shorter than one."""
        tap = getattr(self.sched, "_schedtop", None)
        recorder = getattr(tap, "recorder", None)
        writer = getattr(tap, "writer", None) or getattr(recorder, "sink", None)
        threads = [
            getattr(recorder, "background_thread", None),
            getattr(writer, "_thread", None),
        ]
        server = getattr(recorder, "server", None)
        if server is not None:  # its viewers' connections, and the one that accepts them
            names = (f"schedtop-viewer-{server.port}", server.thread.name)
            threads += [t for t in threading.enumerate() if t.name in names]
        return sum(
            time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            for t in threads
            if t is not None and t.ident is not None and t.is_alive()
        )

    def viewing(self) -> bool:
        """Whether the viewer (if any) streams: its first snapshot was served."""
        recording = getattr(getattr(self.sched, "_schedtop", None), "recorder", None)
        return self.viewer is None or bool(recording._hub.live)

    def trace_bytes(self) -> int:
        """The trace's bytes so far (every record recorded so far appended)."""
        tap = getattr(self.sched, "_schedtop", None)
        if tap is None or tap.recorder is None:
            return 0
        tap.recorder.drain()
        writer = tap.writer or getattr(tap.recorder, "sink", None)
        return int(writer.offset) if writer is not None else 0

    def close(self) -> None:
        self.sched.shutdown()
        if self.viewer is not None:
            self.viewer.kill()
            self.viewer.wait()


def measure(
    n: int,
    is_async: bool,
    steps: int,
    repeats: int,
    tmp: Path,
    churn: bool = False,
    live: tuple[str, ...] = (),
) -> dict[str, dict[str, float]]:
    """vLLM's plain scheduler and the recording one, stepped in turn; with `live`, also
    the recording with a live port and no viewer ("port") and with one viewer attached
    ("viewer"), in the same turns. Returns each recording's figures by name ("file",
    then the live ones)."""
    warmup = 64 + n if churn else 20  # churn: until the first requests are all replaced
    total = warmup + steps * repeats
    plain = Bench(n, is_async, False, None, total, churn)
    names = ("file", *live)
    recs = {}
    for name in names:
        where = tmp / f"bench-{n}-{is_async}-{churn}-{name}"
        trace = where.with_suffix(".trace") if name == "file" else where
        kind = "" if name == "file" else name
        recs[name] = Bench(n, is_async, True, trace, total, churn, live=kind)
    everyone = [plain, *recs.values()]
    for b in everyone:
        for _ in range(warmup):  # admit everyone (prefill), reach steady decoding
            b.step()
    for b in recs.values():
        deadline = time.monotonic() + 60
        while not b.viewing():  # the viewer attached: its snapshot comes at a step's end
            assert time.monotonic() < deadline, "the viewer never attached"
            b.step()
    # As vLLM's engine core does once it has started (vllm.utils.gc_utils.freeze_gc_heap):
    # a full collection of the two schedulers' heaps would otherwise land, 0.4 s at a
    # time, on whichever step the collector happens to pick.
    gc.collect()
    gc.freeze()
    plain_t: list[float] = []
    rec_t: dict[str, list[float]] = {k: [] for k in names}
    start = {k: b.trace_bytes() for k, b in recs.items()}
    writer0 = {k: b.writer_cpu() for k, b in recs.items()}
    for _ in range(repeats):
        # Step by step in turn, so that all see the same machine (it may be shared).
        tp = 0.0
        tr = dict.fromkeys(names, 0.0)
        for _ in range(steps):
            tp += plain.step()
            for k, b in recs.items():
                tr[k] += b.step()
        plain_t.append(tp / steps)
        for k in names:
            rec_t[k].append(tr[k] / steps)
    plain_us = sum(plain_t) / repeats
    out = {}
    for k, b in recs.items():
        bytes_end = b.trace_bytes()
        writer_s = (b.writer_cpu() - writer0[k]) / (steps * repeats)
        rec_us = sum(rec_t[k]) / repeats
        ratios = [r / p for r, p in zip(rec_t[k], plain_t)]
        out[k] = {
            "plain_us": plain_us * 1e6,
            "rec_us": rec_us * 1e6,
            "overhead": rec_us / plain_us - 1,
            "best": min(ratios) - 1,
            "median": median(ratios) - 1,
            # The recorder's threads (they encode the records and write the file), as a
            # share of vLLM's own schedule + update time: the engine's process pays them.
            "writer": writer_s / plain_us,
            "all": (rec_us + writer_s) / plain_us - 1,
            # Over every measured step: the snapshot every 256 steps is amortized.
            "bytes": (bytes_end - start[k]) / (steps * repeats),
        }
    for b in recs.values():
        b.close()
    gc.unfreeze()
    for b in everyone:  # every request still decoding: the batch never shrank
        if not churn:
            assert len(b.sched.running) == n and not b.sched.waiting, "the pool ran out"
        assert all(r.num_preemptions == 0 for r in b.sched.requests.values()), "preempted"
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A viewer as `schedtop live` is one: another process, reading and spooling the stream.
VIEWER = """
import sys, time
from tui.remote import RemoteStream
s = RemoteStream(sys.argv[1], reconnect=False)
s.start(timeout_s=120)
while not s.ended:
    time.sleep(0.5)
"""


def start_viewer(port: int) -> subprocess.Popen[bytes]:
    root = str(Path(__file__).resolve().parent.parent)
    return subprocess.Popen(
        [sys.executable, "-c", VIEWER, f"http://127.0.0.1:{port}"],
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--running", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--no-churn", action="store_true", help="steady decoding only (no churn rows)")
    ap.add_argument(
        "--load",
        choices=("steady", "churn"),
        nargs="+",
        default=["steady", "churn"],
        help="which loads' rows (default both; --no-churn is --load steady)",
    )
    ap.add_argument(
        "--scheduler",
        choices=("sync", "async"),
        nargs="+",
        default=["sync", "async"],
        help="which schedulers' rows: Scheduler (sync), AsyncScheduler (async); default both",
    )
    ap.add_argument(
        "--live",
        action="store_true",
        help="also the live port (SCHEDTOP_LIVE_PORT): with no viewer, and with one",
    )
    args = ap.parse_args()
    import vllm

    live = ("port", "viewer") if args.live else ()
    print(
        f"vLLM {vllm.__version__}; {args.steps} decode steps per round, {args.repeats} rounds "
        "step by step in turn; CPU time of schedule() + update_from_output() per step"
    )
    head = (
        f"{'running':>8} {'load':>7} {'scheduler':>15} {'vLLM us/step':>13} {'recording':>10} "
        f"{'overhead':>9} {'best':>7} {'median':>7} {'threads':>8} {'all':>7} {'bytes/step':>11}"
    )
    if live:
        head += f" {'port':>7} {'port+all':>8} {'viewer':>7} {'viewer+all':>10}"
    print(head)
    with tempfile.TemporaryDirectory() as tmp:
        loads = ["steady"] if args.no_churn else args.load
        for churn in [load == "churn" for load in ("steady", "churn") if load in loads]:
            for n in args.running:
                for is_async in [s == "async" for s in ("sync", "async") if s in args.scheduler]:
                    rs = measure(n, is_async, args.steps, args.repeats, Path(tmp), churn, live)
                    r = rs["file"]
                    name = "AsyncScheduler" if is_async else "Scheduler"
                    load = "churn" if churn else "steady"
                    line = (
                        f"{n:>8} {load:>7} {name:>15} {r['plain_us']:>13.0f} {r['rec_us']:>10.0f} "
                        f"{r['overhead']:>+9.1%} {r['best']:>+7.1%} {r['median']:>+7.1%} "
                        f"{r['writer']:>+8.1%} {r['all']:>+7.1%} {r['bytes']:>11.0f}"
                    )
                    if live:
                        p, v = rs["port"], rs["viewer"]
                        line += (
                            f" {p['overhead']:>+7.1%} {p['all']:>+8.1%}"
                            f" {v['overhead']:>+7.1%} {v['all']:>+10.1%}"
                        )
                    print(line, flush=True)


if __name__ == "__main__":
    main()
