"""What recording costs: time per step with and without the recorder, and bytes per step
next to a naive encoding, for the simulated engine with 256 requests decoding.

    .venv/bin/python bench/recorder_bench.py [--runs 5] [--steps 512]

Timing: two engines run the same workload side by side, stepped alternately (which one
goes first swaps every step), one of them recording into a real file as `schedtop run`
and `sim` do (open_recording: written about every 10 ms as the engine steps, its steady
steps encoded then, in one batch; --background: encoded and written on the recorder's own
thread; --flush-every-step: encoded and written at every step's end, as before issue 28).
On a machine shared with other work this pairing cancels most of the disturbance that
separate runs suffer; a control pair with no recorder at all shows what is left of it.
Per-step medians leave out the steps that write a snapshot; means include them. The
recorder's own CPU time is measured inside its on_step, in runs of their own: the CPU
clock's system calls would slow the recorded engine of the runs compared.

Sizes: the step records of steady decode steps, the snapshots amortized over them, and
the same steps encoded naively (one msgpack map per step: the whole Step plus every
request's full state)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.records import Kind, KVEvents, Step  # noqa: E402
from engine.sim.driver import make_engine, run_steps  # noqa: E402
from engine.sim.workload import SimWorkload, parse_workload  # noqa: E402
from recorder.reader import TraceReader  # noqa: E402
from recorder.recorder import (  # noqa: E402
    Recorder,
    RecorderOptions,
    open_recording,
)
from recorder.schema import Snapshot  # noqa: E402
from recorder.writer import TraceWriter  # noqa: E402

RUNNING = 256
VOCAB = 49152  # the default model's (SmolLM2), so token ids take 2 bytes


def workload(steps: int) -> SimWorkload:
    """256 requests sharing a 64-token system prompt, each decoding for longer than the
    run; prompt lengths vary so that requests fill blocks on different steps, as in a
    long-running server; the pool holds them all with room to spare."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(64)]
    out = steps + 64
    requests = [
        dict(
            id=f"req-{i:04d}",
            arrival_step=0,
            prompt_token_ids=system + [rng.randrange(VOCAB) for _ in range(64 + i % 16)],
            output_token_ids=[rng.randrange(VOCAB) for _ in range(out)],
            max_tokens=out,
        )
        for i in range(RUNNING)
    ]
    blocks_needed = RUNNING * (144 + out) // 16
    config = dict(
        block_size=16,
        num_blocks=blocks_needed * 3 // 2,
        max_num_seqs=RUNNING,
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    return parse_workload({"config": config, "requests": requests}, source="bench")


def warm_up(w: SimWorkload, engine: EngineCore) -> Any:
    """Steps until every request decodes; returns the step iterator."""
    steps = run_steps(w, engine)
    while True:
        report = next(steps).report
        if len(report.scheduled) == RUNNING and all(
            s.kind == Kind.DECODE for s in report.scheduled
        ):
            return steps


class _Timed:
    """An event sink wrapper that adds up the CPU time its inner sink takes.

    Only in runs of its own (twin_run's `timed`): the thread's CPU clock is a system
    call, 0.3-1.5 µs here, and two a step slowed the recorded engine only (about 0.5%
    of its step), in the runs whose step times are compared."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner
        self.seconds = 0.0

    def on_step(self, report: Step) -> None:
        t = time.thread_time()
        self.inner.on_step(report)
        self.seconds += time.thread_time() - t

    def close(self) -> None:
        self.inner.close()


def twin_run(
    w: SimWorkload,
    steps: int,
    trace: Path | None,
    recorded_first: bool,
    every_step: bool = False,
    background: bool = False,
    timed: bool = False,
) -> tuple[list[float], list[float], float]:
    """Per-step wall times of a plain engine and of its twin (recording into `trace`, or
    plain as well when it is None), and the recorder's CPU share of its engine's time.
    The twin records as `schedtop run` and `sim` do (open_recording); `background`: with
    the recorder's encoding thread; `every_step`: into a writer that flushes at every
    step's end, as they did before issue 28. The share is measured only when `timed`
    (its clock then slows the twin's steps); else it is 0."""
    engines = [make_engine(w), make_engine(w)]
    twin = engines[0] if recorded_first else engines[1]
    plain = engines[1] if recorded_first else engines[0]
    clocked = None
    if trace is not None:
        if every_step:  # the recording of before issue 28
            recorder = Recorder(twin, TraceWriter(trace))
        else:
            recorder = open_recording(twin, trace, background=background)
        if timed:
            clocked = _Timed(recorder)
            twin.sink = clocked
    runs = [warm_up(w, plain), warm_up(w, twin)]
    threads_cpu = 0.0
    if clocked is not None:
        clocked.seconds = 0.0
        threads_cpu = -_threads_cpu(clocked.inner)
    times: tuple[list[float], list[float]] = ([], [])
    cpu = time.process_time()
    for i in range(steps):
        for k in (0, 1) if i % 2 else (1, 0):
            start = time.perf_counter()
            next(runs[k])
            times[k].append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    share = 0.0
    if clocked is not None:
        # The recorder's own threads (flush timer, encoding thread) count as its cost
        # too: on the simulated engine they take the interpreter from the engine.
        threads_cpu += _threads_cpu(clocked.inner)
        engines_cpu = cpu - threads_cpu
        share = (clocked.seconds + threads_cpu) / (
            engines_cpu * sum(times[1]) / (sum(times[0]) + sum(times[1]))
        )
    for engine in engines:
        engine.close()
    return times[0], times[1], share


def _threads_cpu(recorder: Recorder) -> float:
    """CPU seconds the recorder's own threads have used so far."""
    return sum(
        time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for t in recorder.own_threads
        if t.ident is not None and t.is_alive()
    )


def naive_size(report: Step, engine: EngineCore) -> int:
    """One msgpack map per step: the report and every request's state, field names and all."""
    state = engine.snapshot()
    fields = dataclasses.asdict(dataclasses.replace(report, kv_events=KVEvents(), scheduled=()))
    fields["kv_events"] = [dataclasses.asdict(e) for e in report.kv_events.events()]
    # Spelled out entry by entry: the engine's scheduled entries need not be a tuple of
    # dataclasses (wt-28a's Entries reads as one), which asdict would leave as it is.
    fields["scheduled"] = [dataclasses.asdict(e) for e in report.scheduled]
    return len(
        msgpack.packb(
            {
                "report": fields,
                "requests": [dataclasses.asdict(r) for r in state.requests],
                "running": state.running,
                "waiting": state.waiting,
            },
            use_bin_type=True,
        )
    )


def sizes(w: SimWorkload, steps: int, redact: bool, trace: Path) -> dict[str, float]:
    """Bytes per steady decode step: step records, snapshots, and the naive encoding."""
    engine = make_engine(w)
    Recorder(engine, TraceWriter(trace, live=False), RecorderOptions(redact_prompts=redact))
    it = warm_up(w, engine)
    naive = []
    for _ in range(steps):
        result = next(it)
        naive.append(naive_size(result.report, engine))
    last = result.report.step
    engine.close()
    step_bytes: list[int] = []
    snap_bytes: list[int] = []
    with TraceReader(trace) as reader:
        entries = list(reader.entries())
    for entry, after in zip(entries, entries[1:]):
        rec, size = entry.record, after.offset - entry.offset
        if isinstance(rec, Step) and last - steps < rec.step <= last:
            step_bytes.append(size)
        elif isinstance(rec, Snapshot) and last - steps < rec.step <= last:
            snap_bytes.append(size)
    return dict(
        step=statistics.mean(step_bytes),
        snap=sum(snap_bytes) / steps,
        snap_each=statistics.mean(snap_bytes) if snap_bytes else 0.0,
        snap_every=steps / max(1, len(snap_bytes)),
        naive=statistics.mean(naive),
    )


def real_model_row(steps: int, tmp: Path) -> str:
    """The default model, 32 requests decoding: a plain engine and a recording twin,
    stepped alternately, as above. At real step times the recorder's share is small, so
    its own CPU time (inside on_step) is the precise figure; the wall ratio is there to
    show nothing else moved."""
    try:
        from engine.config import RunnerOptions
        from engine.model.llm_engine import LLMEngine
        from engine.model.loader import default_model_path, load_model
        from engine.request import SamplingParams

        default_model_path()
    except Exception as e:  # noqa: BLE001 - any reason is "cannot measure here"
        return f"real default model        not measured: {e}"
    import torch

    loaded = load_model()
    config = EngineConfig(
        block_size=16,
        num_blocks=1024,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=2048,
    )
    options = RunnerOptions(num_gpu_blocks_override=1024, num_threads=torch.get_num_threads())
    engines = [LLMEngine(loaded, config, options), LLMEngine(loaded, config, options)]
    timed = _Timed(Recorder(engines[1].core, TraceWriter(tmp / "real.trace")))
    engines[1].core.sink = timed
    rng = random.Random(0)
    prompts = [[rng.randrange(17, VOCAB) for _ in range(48)] for _ in range(32)]
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for e in engines:
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
        for _ in range(4):  # the prefill and a few decodes: steady state from here
            e.step()
    timed.seconds = 0.0
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps):
        for k in (0, 1) if i % 2 else (1, 0):
            start = time.perf_counter()
            engines[k].step()
            times[k].append(time.perf_counter() - start)
    for e in engines:
        e.close()
    plain, rec = statistics.median(times[0]), statistics.median(times[1])
    share = timed.seconds / sum(times[1])
    return (
        f"real default model, 32 decoding, {steps} steps: {plain * 1e3:.1f} ms/step alone, "
        f"{rec * 1e3:.1f} ms recorded ({rec / plain - 1:+.1%} wall);\n"
        f"  {'':26}recorder's own time {timed.seconds / steps * 1e6:.0f} us/step = "
        f"{share:.2%} of the step   (target <= 1%)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each kind (default 5)")
    parser.add_argument("--steps", type=int, default=512, help="timed steps per run")
    parser.add_argument(
        "--real-steps",
        type=int,
        default=48,
        help="timed steps of the default model per engine (0: skip)",
    )
    parser.add_argument(
        "--flush-every-step",
        action="store_true",
        help="record as before issue 28: on the engine's thread, written at every step's end",
    )
    parser.add_argument(
        "--background",
        action="store_true",
        help="encode and write on the recorder's own thread (open_recording(background=True))",
    )
    args = parser.parse_args()
    w = workload(args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="recorder-bench-"))
    pools: dict[str, list[float]] = {k: [] for k in ("a", "a2", "plain", "rec")}
    shares: list[float] = []
    for i in range(args.runs):
        a, a2, _ = twin_run(w, args.steps, None, i % 2 == 0)
        plain, rec, _ = twin_run(
            w,
            args.steps,
            tmp / f"run{i}.trace",
            i % 2 == 0,
            every_step=args.flush_every_step,
            background=args.background,
        )
        _, _, share = twin_run(
            w,
            args.steps,
            tmp / f"timed{i}.trace",
            i % 2 == 0,
            every_step=args.flush_every_step,
            background=args.background,
            timed=True,
        )
        for key, values in (("a", a), ("a2", a2), ("plain", plain), ("rec", rec)):
            pools[key] += values
        shares.append(share)
    t = {f"median_{k}": statistics.median(v) for k, v in pools.items()}
    t.update({f"mean_{k}": statistics.mean(v) for k, v in pools.items()})
    t["share"] = statistics.median(shares)
    full = sizes(w, args.steps, False, tmp / "sizes.trace")
    red = sizes(w, args.steps, True, tmp / "redacted.trace")
    real = real_model_row(args.real_steps, tmp) if args.real_steps else "real model: skipped"
    _print(args, w, t, full, red, real)
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()


def _print(
    args: argparse.Namespace,
    w: SimWorkload,
    t: dict[str, float],
    full: dict[str, float],
    red: dict[str, float],
    real: str,
) -> None:
    cfg = w.config
    total = full["step"] + full["snap"]

    def ratio(stat: str) -> str:
        return f"{t[f'{stat}_rec'] / t[f'{stat}_plain'] - 1:+.1%}"

    def control(stat: str) -> str:
        return f"{t[f'{stat}_a2'] / t[f'{stat}_a'] - 1:+.1%}"

    ms: Callable[[float], str] = lambda s: f"{s * 1e3:7.3f} ms"  # noqa: E731
    lines = [
        f"recorder benchmark: {RUNNING} requests decoding, block_size {cfg.block_size}, "
        f"{cfg.num_blocks} blocks, token ids < {VOCAB}",
        f"python {platform.python_version()}, {os.cpu_count()} CPUs; {args.runs} pairs of "
        f"engines stepped alternately for {args.steps} steps, and {args.runs} control pairs",
        "",
        "time per step                           median            mean (with snapshots)",
        f"  engine alone              {ms(t['median_plain'])}          {ms(t['mean_plain'])}",
        f"  engine + recorder (file)  {ms(t['median_rec'])} {ratio('median'):>8}"
        f" {ms(t['mean_rec'])} {ratio('mean'):>8}   (target <= +5%)",
        f"  control: plain vs plain   {'':10} {control('median'):>8} {'':10}"
        f" {control('mean'):>8}   (the method's noise)",
        f"  recorder's own CPU share  {'':10} {t['share']:+8.1%}   (its threads' included)",
        f"  {real}",
        "",
        "bytes per steady decode step          token ids    redacted",
        f"  step records                      {full['step']:9,.0f}   {red['step']:9,.0f}",
        f"  snapshots, amortized              {full['snap']:9,.0f}   {red['snap']:9,.0f}"
        f"   (one every {full['snap_every']:.0f} steps: {full['snap_each'] / 1024:,.0f} KiB)",
        f"  total                             {total:9,.0f}   {red['step'] + red['snap']:9,.0f}",
        f"  naive: a map per step, all state  {full['naive']:9,.0f}",
        f"  naive / step records              {full['naive'] / full['step']:8.0f}x"
        "   (target >= 10x, step records <= 2,048 B)",
        f"  naive / total                     {full['naive'] / total:8.0f}x",
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
