"""What the TUI costs, headless (issue 6):

1. render: one frame with 4096 KV blocks and 1000 requests, built by the reader
   thread's session (the view-model) and drawn by the app (panes updated, layout, the
   whole screen composed and turned into the terminal's bytes) — target < 30 ms;
2. live: the rate of appended steps that live mode keeps up with, with no growing lag:
   another process appends a recorded trace's steps at R steps/s (a byte pump, so that the
   writer is never the limit) while the app follows; the lag is the steps written but not
   yet on screen — target >= 500 steps/s (issue 6), 10,000 steps/s with every step's
   events in the log (issue 28); the app's CPU per step is printed too, since on a shared
   machine the wall-clock lag also measures the other jobs;
3. go to: a random step of a 1,000,000-step trace with 256 running requests, frame built
   and drawn — target < 100 ms;
4. incidents: the `i` view opened on the long trace, from the key to its list on screen
   (the reader thread scans the trace in slices from the start, so the view opens at once
   and fills in) — target < 200 ms; the scan's own speed; and the view with 100,000
   preemptions listed, sorted and drawn.

    .venv/bin/python bench/tui_bench.py [--trace BIG.trace] [--rates 500,1000,2000,4000]
        [--parts 1,2,3,4]

For 3 it takes --trace, else /tmp/schedtop-bench/1m-256.trace when it exists (the lead's
bench/replay_bench.py writes it), else it records a smaller trace of the same kind (256
requests decoding) and says so: the cost of a jump depends on the snapshot interval and
the state's size, not on the trace's length (the index is read from the footer).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# --code-from TREE: import schedtop from another checkout (its reader cost, side by side
# with this one's: `--parts 2 --reader-only --code-from ../main`).
_ROOT = Path(__file__).resolve().parent.parent
if "--code-from" in sys.argv[:-1]:
    _ROOT = Path(sys.argv[sys.argv.index("--code-from") + 1]).resolve()
sys.path.insert(0, str(_ROOT))

from rich.console import Console  # noqa: E402

from engine.records import percentile  # noqa: E402
from engine.sim.driver import make_engine, run_steps  # noqa: E402
from engine.sim.workload import SimWorkload, parse_workload  # noqa: E402
from recorder.reader import TraceReader  # noqa: E402
from recorder.recorder import Recorder  # noqa: E402
from recorder.writer import TraceWriter  # noqa: E402
from tui.app import SchedtopApp  # noqa: E402
from tui.commands import Goto  # noqa: E402
from tui.launch import open_session  # noqa: E402
from tui.session import Session  # noqa: E402
from tui.viewmodel import Frame  # noqa: E402
from tui.worker import FrameSource  # noqa: E402

BIG_TRACE = Path("/tmp/schedtop-bench/1m-256.trace")
FALLBACK = Path("/tmp/schedtop-bench/tui-256.trace")  # cached between runs
FALLBACK_STEPS = 20_000
SIZE = (160, 50)  # a full-screen terminal
VOCAB = 49152


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def record(w: SimWorkload, path: Path, steps: int | None = None) -> None:
    """Simulate `w` into a trace file (the first `steps` steps only, when given)."""
    engine = make_engine(w)
    recorder = Recorder(engine, TraceWriter(path, live=False))
    for i, _ in enumerate(run_steps(w, engine)):
        if steps is not None and i + 1 >= steps:
            break
    recorder.close()


# -- 1. one frame with 4096 blocks and 1000 requests ---------------------------------------------


def heavy_workload() -> SimWorkload:
    """1000 requests at once on a 4096-block pool: a few hundred run, the rest wait, the
    pool is full, requests preempt each other."""
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(32)]
    requests = [
        dict(
            id=f"req-{i:04d}",
            arrival_step=i // 50,
            prompt_token_ids=system + [rng.randrange(VOCAB) for _ in range(24 + i % 40)],
            output_token_ids=[rng.randrange(VOCAB) for _ in range(400)],
            max_tokens=400,
        )
        for i in range(1000)
    ]
    config = dict(
        block_size=16,
        num_blocks=4097,
        max_num_batched_tokens=4096,
        max_num_seqs=512,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    return parse_workload({"config": config, "requests": requests}, source="heavy")


def render_cost(app: SchedtopApp, frame: Frame) -> tuple[float, float]:
    """(wall, CPU) seconds to show `frame`: the panes take their parts, the layout is
    refreshed, and the whole screen is composed and encoded as a terminal would receive
    it. The reader thread is stopped, so the process's CPU time is this work alone (on a
    shared machine, wall time also counts waiting for a CPU)."""
    console = Console(
        file=io.StringIO(),
        width=SIZE[0],
        height=SIZE[1],
        force_terminal=True,
        color_system="truecolor",
        legacy_windows=False,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    app.frame = frame
    screen = app.screen
    screen._refresh_layout()
    update = screen._compositor.render_update(full=True)
    update.render_segments(console)
    return time.perf_counter() - t0, time.process_time() - c0


async def bench_render(trace: Path, steps: list[int]) -> dict[str, list[float]]:
    builder = open_session(trace, live=False)
    app = SchedtopApp(open_session(trace, live=False))
    out: dict[str, list[float]] = {"build": [], "build CPU": [], "draw": [], "draw CPU": []}
    async with app.run_test(size=SIZE) as pilot:
        while app.frame is None:
            await pilot.pause(0.05)
        app.source.stop()  # the bench feeds the app its frames from here on
        await pilot.pause(0.1)
        for step in steps * 5:
            t0, c0 = time.perf_counter(), time.process_time()
            builder.handle(Goto(step))
            frame = builder.frame()
            out["build"].append(time.perf_counter() - t0)
            out["build CPU"].append(time.process_time() - c0)
            wall, cpu = render_cost(app, frame)
            out["draw"].append(wall)
            out["draw CPU"].append(cpu)
            await pilot.pause(0)
    return out


# -- 2. live mode against a fast writer ----------------------------------------------------------


LIVE_SOURCE = Path("/tmp/schedtop-bench/tui-live.trace")  # cached between runs


def live_workload(steps: int) -> SimWorkload:
    """About 32 requests running; one arrives and one finishes every few steps."""
    rng = random.Random(2)
    n = steps // 6 + 32
    requests = [
        dict(
            id=f"r{i}",
            arrival_step=i * 6,
            prompt_token_ids=[rng.randrange(VOCAB) for _ in range(48)],
            output_token_ids=[7] * 190,
            max_tokens=190,
        )
        for i in range(n)
    ]
    config = dict(
        block_size=16,
        num_blocks=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        max_model_len=1024,
    )
    return parse_workload({"config": config, "requests": requests}, source="live")


def pump(source: Path, dest: Path, rate: float, log: Path) -> None:
    """Append `source`'s records to `dest` as a writer at `rate` steps per second would
    (whole records, every 2 ms), logging "wall_ns steps_written" as it goes. Copying bytes
    costs next to nothing, so the pace is the reader's problem alone."""
    with TraceReader(source) as reader:
        offsets = list(reader.index().step_offsets)
    data = source.read_bytes()
    with open(dest, "wb", buffering=0) as out, open(log, "w") as progress:
        out.write(data[: offsets[0]])  # preamble and header
        t0 = time.monotonic()
        written = 0
        while written < len(offsets) - 1:
            due = min(len(offsets) - 1, int((time.monotonic() - t0) * rate))
            if due > written:
                out.write(data[offsets[written] : offsets[due]])
                written = due
                progress.write(f"{time.time_ns()} {written}\n")
            time.sleep(0.002)
        out.write(data[offsets[-1] :])


@dataclass
class Followed:
    """What the app did while following: samples of the step on screen, and the CPU its
    two threads took (the writer is another process)."""

    samples: list[tuple[int, int]]  # (wall ns, step on screen) every 20 ms
    cpu: float  # the app's CPU seconds, all threads
    reader_cpu: float  # the reader thread's (decode, reduce, digest, build frames)
    ui_cpu: float  # the UI thread's (panes, layout, drawing; and the bench's sampling)
    digested: int  # steps the reader digested
    frames: int  # frames built (and so drawn)


async def follow(app: SchedtopApp, seconds: float) -> Followed:
    """The app followed for `seconds`, once the first step is shown."""
    samples = []
    clocks: list[int] = []  # the reader thread's CPU clock
    run = app.source.run

    def timed_run() -> None:
        clocks.append(time.pthread_getcpuclockid(threading.get_ident()))
        run()

    app.source.run = timed_run  # type: ignore[method-assign]  # on_mount starts it
    async with app.run_test(size=SIZE):
        # Plain sleeps: Pilot.pause() also forces screen updates, which is not what a
        # terminal does between frames.
        while app.frame is None or app.frame.header.step < 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # the backlog written while the app started
        end = time.monotonic() + seconds
        # The session is the reader thread's; reading its counters is safe enough.
        session = app.source.session
        c0, made0, seq0 = time.process_time(), session.history.made, session.seq
        r0, u0 = time.clock_gettime(clocks[0]), time.thread_time()
        while time.monotonic() < end:
            samples.append((time.time_ns(), app.frame.header.step))  # type: ignore[union-attr]
            await asyncio.sleep(0.02)
        r1, u1 = time.clock_gettime(clocks[0]), time.thread_time()
        cpu, made = time.process_time() - c0, session.history.made - made0
        frames = session.seq - seq0
    return Followed(samples, cpu, r1 - r0, u1 - u0, made, frames)


def bench_live(rate: int, seconds: float, tmp: Path) -> dict[str, float]:
    dest, log = tmp / f"live-{rate}.trace", tmp / f"live-{rate}.log"
    writer = subprocess.Popen(
        [sys.executable, __file__, "--pump", str(LIVE_SOURCE), str(dest), str(rate), str(log)]
    )
    try:
        TraceReader.wait_for(dest, 30).close()
        app = SchedtopApp(open_session(dest, live=True))
        f = asyncio.run(follow(app, seconds))
    finally:
        writer.kill()
        writer.wait()
    samples = f.samples
    progress = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    lags = []
    for t, shown in samples:
        written = max((n for w, n in progress if w <= t), default=0)  # steps 0..written-1
        lags.append(max(0, written - 1 - shown))
    first, last = lags[: len(lags) // 3], lags[-len(lags) // 3 :]
    span = [(w, n) for w, n in progress if samples[0][0] <= w <= samples[-1][0]]
    achieved = (span[-1][1] - span[0][1]) / ((span[-1][0] - span[0][0]) / 1e9)
    return {
        "rate": achieved,
        "median": statistics.median(lags),
        "p95": _pct(lags, 95),
        "max": max(lags),
        "first": statistics.mean(first),
        "last": statistics.mean(last),
        "share": f.cpu / seconds,  # of one core, what the app got (a shared machine)
        "us_per_step": f.cpu / max(1, f.digested) * 1e6,  # the app's CPU per digested step
        "digested": f.digested / seconds,
        "fps": f.frames / seconds,
        "reader_us": f.reader_cpu / max(1, f.digested) * 1e6,
        "ui_ms": f.ui_cpu / max(1, f.frames) * 1e3,
    }


def _pct(values: list[float], p: float) -> float:
    return percentile(values, p) or 0.0  # the one percentile (engine.records)


def live_source(steps: int) -> None:
    if LIVE_SOURCE.exists():
        with TraceReader(LIVE_SOURCE) as reader:
            if reader.index().last_step + 1 >= steps:
                return
    LIVE_SOURCE.parent.mkdir(parents=True, exist_ok=True)
    print(f"(recording {steps:,} steps for the writer to replay: {LIVE_SOURCE}, kept)", flush=True)
    tmp = LIVE_SOURCE.with_suffix(".tmp")
    record(live_workload(steps), tmp, steps)
    os.replace(tmp, LIVE_SOURCE)


# -- 3. go to a random step of a long trace -------------------------------------------------


def long_trace(requested: Path | None) -> tuple[Path, str]:
    if requested is not None:
        return requested, "given with --trace"
    if BIG_TRACE.exists():
        return BIG_TRACE, "the 1M-step trace of bench/replay_bench.py"
    if not FALLBACK.exists():
        FALLBACK.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"NOTE: {BIG_TRACE} is missing; recording a {FALLBACK_STEPS:,}-step trace with "
            f"256 running requests instead ({FALLBACK}, kept for later runs; about a "
            "minute)",
            flush=True,
        )
        tmp = FALLBACK.with_suffix(".tmp")
        record(decode_workload(FALLBACK_STEPS), tmp, FALLBACK_STEPS)
        os.replace(tmp, FALLBACK)
    return FALLBACK, (
        f"NOT the 1M-step trace ({BIG_TRACE} is missing): a "
        f"{FALLBACK_STEPS:,}-step one of the same kind"
    )


def decode_workload(steps: int) -> SimWorkload:
    """256 requests running at every step: each shares a 64-token system prompt, decodes
    500 tokens and finishes, and a new one arrives in its place (a long-running server)."""
    rng = random.Random(0)
    system = [rng.randrange(VOCAB) for _ in range(64)]
    out, running = 500, 256
    later = steps * running // out
    requests = [
        dict(
            id=f"req-{i:05d}",
            arrival_step=0 if i < running else (i - running) * out // running,
            prompt_token_ids=system + [rng.randrange(VOCAB) for _ in range(64)],
            output_token_ids=[7] * out,
            max_tokens=out,
        )
        for i in range(running + later)
    ]
    config = dict(
        block_size=16,
        num_blocks=running * ((128 + out) // 16 + 3) + 64,
        max_num_batched_tokens=8192,
        max_num_seqs=running,
        max_model_len=1024,
    )
    return parse_workload({"config": config, "requests": requests}, source="decode-256")


async def bench_goto(trace: Path, jumps: int) -> dict[str, list[float]]:
    builder: Session = open_session(trace, live=False)
    last = builder.tl.last_step
    rng = random.Random(3)
    app = SchedtopApp(open_session(trace, live=False))
    seeker = open_session(trace, live=False).tl  # the Timeline alone, for comparison
    out: dict[str, list[float]] = {
        "seek": [],
        "build": [],
        "draw": [],
        "total": [],
        "total CPU": [],
    }
    async with app.run_test(size=SIZE) as pilot:
        while app.frame is None:
            await pilot.pause(0.05)
        app.source.stop()
        await pilot.pause(0.1)
        for _ in range(jumps):
            step = rng.randrange(last + 1)
            t0 = time.perf_counter()
            seeker.state(step)
            out["seek"].append(time.perf_counter() - t0)
            t0, c0 = time.perf_counter(), time.process_time()
            builder.handle(Goto(step))
            frame = builder.frame()
            t1, c1 = time.perf_counter(), time.process_time()
            draw, draw_cpu = render_cost(app, frame)
            out["build"].append(t1 - t0)
            out["draw"].append(draw)
            out["total"].append(t1 - t0 + draw)
            out["total CPU"].append(c1 - c0 + draw_cpu)
            await pilot.pause(0)
    return out


# -- the report ------------------------------------------------------------------------------------


def row(name: str, values: list[float], target: str) -> str:
    return (
        f"| {name} | {ms(statistics.median(values))} | {ms(_pct(values, 95))} | "
        f"{ms(max(values))} | {target} |"
    )


def main() -> None:
    if sys.argv[1:2] == ["--pump"]:
        source, dest, rate, log = sys.argv[2:6]
        pump(Path(source), Path(dest), float(rate), Path(log))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help="a long trace for the go-to benchmark")
    parser.add_argument(
        "--rates", default="500,1000,2000,5000,10000", help="live: writer rates to try, in steps/s"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="live: seconds per rate")
    parser.add_argument("--jumps", type=int, default=30, help="go to: random jumps")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run")
    parser.add_argument(
        "--reader-only", action="store_true", help="live: the reader thread's cost alone"
    )
    parser.add_argument(
        "--reader-steps",
        type=int,
        default=20_000,
        help="live: steps the reader's work alone is measured over (two runs under "
        "cachegrind, at two counts, give its instructions per step)",
    )
    parser.add_argument(
        "--code-from", metavar="TREE", help="import schedtop from this checkout instead"
    )
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    print(
        f"machine: {platform.node()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; terminal {SIZE[0]}x{SIZE[1]} (headless)\n"
    )

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        if parts & {1, 2}:
            render_and_live(args, parts, tmp)
    if not parts & {3, 4}:
        return
    trace, what = long_trace(args.trace)
    with TraceReader(trace) as reader:
        steps = reader.index().last_step + 1
    if 3 in parts:
        goto_part(trace, what, steps, args.jumps)
    if 4 in parts:
        incidents_part(trace, what, steps)


def render_and_live(args: argparse.Namespace, parts: set[int], tmp: Path) -> None:
    if 1 in parts:
        render_part()
    if 2 in parts:
        live_part(args, tmp)


def render_part() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        heavy = Path(tmp_name) / "heavy.trace"
        record(heavy_workload(), heavy, 120)
        probe = open_session(heavy, live=False).tl
        best = max(
            range(probe.first_step, probe.last_step + 1),
            key=lambda s: (len(probe.state(s).requests), -len(probe.state(s).free)),
        )
        state = probe.state(best)
        print(
            f"1. render: step {best} of a trace with {state.num_blocks - 1} usable blocks "
            f"({state.num_blocks - 1 - len(state.free)} in use), {len(state.requests)} "
            f"requests ({len(state.running)} running, {len(state.waiting)} waiting)"
        )
        render = asyncio.run(bench_render(heavy, [best, best - 1, best - 2, best - 3]))
        print("| cost | median ms | p95 ms | max ms | target |")
        print("| --- | ---: | ---: | ---: | --- |")
        print(row("build the frame (reader thread), wall", render["build"], ""))
        print(row("build the frame, CPU", render["build CPU"], ""))
        print(row("draw it (UI thread), wall", render["draw"], "< 30 ms"))
        print(row("draw it, CPU", render["draw CPU"], "< 30 ms"))
        print()


def reader_cost(tmp: Path, steps: int = 20_000, batch: int = 500) -> tuple[float, int]:
    """The reader thread's work alone, with no app and no other process: the live source
    appended to a file `batch` steps at a time (what a writer at 10,000 steps/s adds
    between two frames at 20 a second), a frame built after each batch as the worker
    would. Returns (CPU seconds per step, steps the notes say were skipped)."""
    with TraceReader(LIVE_SOURCE) as reader:
        offsets = list(reader.index().step_offsets)
    data = LIVE_SOURCE.read_bytes()
    dest = tmp / "reader-cost.trace"
    dest.write_bytes(data[: offsets[100]])
    session = open_session(dest, live=True, named_writer=False)
    source = FrameSource(session, lambda: None, lambda *_: None)
    source.run_once()
    written = 100
    steps = min(steps, len(offsets) - batch - 1)
    with open(dest, "ab", buffering=0) as out:
        c0 = time.process_time()
        while written < steps:
            out.write(data[offsets[written] : offsets[written + batch]])
            written += batch
            source.run_once()
        cpu = time.process_time() - c0
    skipped = sum(
        int(e.text.split(" steps")[0].replace(",", ""))
        for e in session.notes
        if e.kind == "note" and "not read" in e.text
    )
    session.close()
    return cpu / (written - 100), skipped


def live_part(args: argparse.Namespace, tmp: Path) -> None:
    rates = [int(r) for r in args.rates.split(",")]
    live_source(int(max(rates) * (args.seconds + 4)))
    per_step, skipped = reader_cost(tmp, 100 + args.reader_steps)
    print(
        "2. live, the reader thread's work alone (no app; batches of 500 steps, a frame "
        f"after each): {per_step * 1e6:.0f} us CPU per step, {skipped} steps skipped: "
        f"one core would follow {1 / per_step:,.0f} steps/s, drawing aside ({_ROOT})"
    )
    if args.reader_only:
        return
    print(
        f"2. live: another process appends a recorded trace's steps at R steps/s, the "
        f"app follows ({args.seconds:g} s per rate); lag = steps written but not yet "
        "on screen"
    )
    print(
        "| writer rate (steps/s) | achieved | viewer: steps digested/s | lag median | "
        "lag p95 | lag max | mean lag, first third -> last third | keeps up | "
        "app CPU (share of a core) | app CPU per digested step | frames/s | "
        "reader CPU per step | UI CPU per frame |"
    )
    print(
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    )
    for rate in rates:
        r = bench_live(rate, args.seconds, tmp)
        # Keeping up: the lag stays under a quarter second's worth of steps and
        # does not grow from the first third of the run to the last.
        steady = r["median"] <= 0.25 * r["rate"] and r["last"] <= max(
            1.5 * r["first"], 0.1 * r["rate"]
        )
        print(
            f"| {rate} | {r['rate']:.0f} | {r['digested']:.0f} | {r['median']:.0f} "
            f"({r['median'] / r['rate'] * 1e3:.0f} ms) | {r['p95']:.0f} | "
            f"{r['max']:.0f} | {r['first']:.0f} -> {r['last']:.0f} | "
            f"{'yes' if steady else 'NO'} | {r['share']:.0%} | {r['us_per_step']:.0f} us | "
            f"{r['fps']:.0f} | "
            f"{r['reader_us']:.0f} us | {r['ui_ms']:.1f} ms |"
        )
    print(
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs. The viewer's "
        "rate is the steps its reader digested for the log per second: the writer's rate "
        "when nothing was skipped. A view that cannot keep up skips ahead and says so: "
        "it then digests fewer steps than were written. The app's CPU per digested step, "
        "drawing included, says what a whole core to itself would follow: about 1e6 / "
        "that many steps a second. Of it, the reader thread's CPU per step and the UI "
        "thread's per frame: a core follows R steps/s at F frames/s while R x reader + "
        "F x UI stays under a second.)"
    )
    print()


def goto_part(trace: Path, what: str, steps: int, jumps: int) -> None:
    print(f"3. go to a random step: {trace} ({what}), {steps:,} steps, {jumps} jumps")
    goto = asyncio.run(bench_goto(trace, jumps))
    print("| cost | median ms | p95 ms | max ms | target |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(row("for comparison: Timeline.state(step) alone, wall", goto["seek"], ""))
    print(row("build the frame (reader thread), wall", goto["build"], ""))
    print(row("draw it (UI thread), wall", goto["draw"], ""))
    print(row("go to, total, wall", goto["total"], "< 100 ms"))
    print(row("go to, total, CPU", goto["total CPU"], "< 100 ms"))
    print()


# -- 4. the incidents view -----------------------------------------------------------------------


class _FirstDraw:
    """When the incidents table first draws a line after `arm()`: the list on screen."""

    def __init__(self) -> None:
        from tui.widgets.incidents import IncidentTable

        self.at: float | None = None
        self.armed = False
        self.rows = 0  # the list drawn must have at least this many rows
        draw = IncidentTable.render_line

        def render_line(table: IncidentTable, y: int) -> object:
            if self.armed and self.at is None and len(table.rows) >= self.rows:
                self.at = time.perf_counter()
            return draw(table, y)

        IncidentTable.render_line = render_line  # type: ignore[method-assign,assignment]

    def arm(self, rows: int = 0) -> None:
        self.at, self.armed, self.rows = None, True, rows


async def bench_incidents(trace: Path, opens: int) -> dict[str, list[float]]:
    """Key `i` to the incidents list drawn, `opens` times: once while the reader thread
    is still scanning, then with the scan done. (Pilot's press() itself waits for the
    app to go idle, which a running scan delays: the time is taken at the first drawn
    line of the list, not when press() returns.)"""
    from tui.screens.incidents import IncidentsScreen

    first_draw = _FirstDraw()
    out: dict[str, list[float]] = {"first": [], "open": [], "scan": []}
    t_start = time.perf_counter()
    app = SchedtopApp(open_session(trace, live=False))
    async with app.run_test(size=SIZE) as pilot:
        while app.frame is None:
            await pilot.pause(0.01)
        await pilot.pause(1.0)  # the app settled (its first frames drawn), the scan going on
        for i in range(opens + 1):
            vm = app.frame.incidents if app.frame is not None else None
            first_draw.arm(0 if vm is None else sum(1 for x in vm.items if x.kind == "preempt"))
            t0 = time.perf_counter()
            await pilot.press("i")
            while first_draw.at is None:
                await pilot.pause(0.001)
            out["first" if i == 0 else "open"].append(first_draw.at - t0)
            if i == 0:
                screen = app.screen
                assert isinstance(screen, IncidentsScreen)
                while screen.vm is None or not screen.vm.done:
                    await pilot.pause(0.05)
                out["scan"].append(time.perf_counter() - t_start)
            await pilot.press("escape")
            while isinstance(app.screen, IncidentsScreen):
                await pilot.pause(0.001)
    return out


async def bench_many_incidents(trace: Path, n: int) -> dict[str, list[float]]:
    """The view over `n` synthetic preemptions: open, sort by tokens lost, filter."""
    from replays.storms import Incident, StormSummary
    from tui.incidents import IncidentsVM
    from tui.screens.incidents import IncidentsScreen
    from tui.widgets.incidents import IncidentTable

    rng = random.Random(0)
    items = tuple(
        Incident(
            i, "preempt", f"r{rng.randrange(5000)}", "itself", rng.randrange(4000), 3, 3, 1, ""
        )
        for i in range(n)
    )
    vm = IncidentsVM(items, StormSummary(n, n, 0, 0, 0, 0, 0, ()), n, n, True, "")
    out: dict[str, list[float]] = {"open": [], "sort": [], "filter": []}
    first_draw = _FirstDraw()
    app = SchedtopApp(open_session(trace, live=False))
    async with app.run_test(size=SIZE) as pilot:
        while app.frame is None:
            await pilot.pause(0.01)
        app.source.stop()  # no more frames: they would bring the trace's own incidents
        await pilot.pause(0.1)
        for _ in range(5):
            first_draw.arm(n)
            t0 = time.perf_counter()
            screen = IncidentsScreen(vm)
            app.push_screen(screen)
            while first_draw.at is None:
                await pilot.pause(0.001)
            out["open"].append(first_draw.at - t0)
            table = screen.query_one(IncidentTable)
            assert len(table.rows) == n
            t0 = time.perf_counter()
            screen.sort_key = "lost"  # the next sort: numbers largest first
            while table.sort != ("lost", False):
                await pilot.pause(0.001)
            out["sort"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            screen.words = "r42"
            while len(table.rows) == n:
                await pilot.pause(0.001)
            out["filter"].append(time.perf_counter() - t0)
            app.pop_screen()
            await pilot.pause(0.01)
    return out


def incidents_part(trace: Path, what: str, steps: int) -> None:
    from replays.storms import IncidentScan

    with TraceReader(trace) as reader:
        t0, c0 = time.perf_counter(), time.process_time()
        scan = IncidentScan(reader)
        scan.advance()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = trace.stat().st_size
    print(
        f"4. incidents: {trace} ({what}), {steps:,} steps, {size / 2**30:.2f} GiB, "
        f"{len(scan.incidents):,} incidents"
    )
    r = asyncio.run(bench_incidents(trace, 10))
    many = asyncio.run(bench_many_incidents(trace, 100_000))
    print("| cost | median ms | p95 ms | max ms | target |")
    print("| --- | ---: | ---: | ---: | --- |")
    print(row("open the view while the scan runs (1 s after start), wall", r["first"], "< 200 ms"))
    print(row("open the view again, scan done, wall", r["open"], "< 200 ms"))
    print(row("open the view over 100,000 preemptions, wall", many["open"], "< 200 ms"))
    print(row("... sort them by tokens lost, wall", many["sort"], ""))
    print(row("... filter them by a request id, wall", many["filter"], ""))
    print(
        f"the scan alone: {steps:,} steps in {wall:.1f} s wall, {cpu:.1f} s CPU "
        f"({steps / wall:,.0f} steps/s, {size / 2**20 / wall:,.0f} MiB/s); in the app, "
        f"from start to done: {r['scan'][0]:.1f} s"
    )


if __name__ == "__main__":
    main()
