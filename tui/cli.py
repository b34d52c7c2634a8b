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
        from engine.sim.workload import WorkloadError
        from recorder.errors import RecordingError, TraceError
        from replays.resim import ResimError

        try:
            return fn(*args, **kwargs)
        except (WorkloadError, TraceError, RecordingError, ResimError) as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="schedtop")
def main() -> None:
    """An LLM serving engine that schedules like vLLM V1, with a flight recorder and a
    terminal debugger for what it records."""


@main.command()
@click.argument("workload", required=False, metavar="[WORKLOAD.json]")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override an engine config key (vLLM's names), e.g. "
                   "--set max_num_batched_tokens=1024. Repeatable.")
@click.option("--decisions", metavar="OUT.jsonl",
              help="Write one JSON line of decisions per step (the fidelity format).")
@click.option("--trace", "trace_path", metavar="PATH",
              help="Record the run into this trace file. Default: a new file in "
                   "$SCHEDTOP_TRACE_DIR (else ~/.cache/schedtop/traces).")
@click.option("--no-trace", is_flag=True, help="Do not record a trace.")
@click.option("--redact-prompts", is_flag=True,
              help="Record prompts and sampled tokens only as lengths and block hashes.")
@user_errors
def sim(workload: str | None, settings: tuple[str, ...], decisions: str | None,
        trace_path: str | None, no_trace: bool, redact_prompts: bool) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload."""
    from engine.sim.api import load, run_sim
    from engine.sim.summary import format_summary

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    w = load(workload, settings)
    recording = _Recording(None if no_trace else trace_path, "sim", redact_prompts,
                           enabled=not no_trace)
    summary = run_sim(w, decisions, on_engine=recording.attach)
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))
    recording.report()


class _Recording:
    """Attaches a recorder to the engine a subcommand builds, then says where it went."""

    def __init__(self, path: str | None, kind: str, redact_prompts: bool,
                 enabled: bool = True) -> None:
        self.path, self.kind, self.redact, self.enabled = path, kind, redact_prompts, enabled
        self.recorder: Any = None

    def attach(self, engine: Any) -> None:
        if self.enabled:
            from recorder.recorder import open_recording

            self.recorder = open_recording(engine, self.path, kind=self.kind,
                                           redact_prompts=self.redact)

    def report(self) -> None:
        rec = self.recorder
        if rec is not None:
            click.echo(f"trace: {rec.path}")
            if rec.error:
                click.echo(f"schedtop: warning: recording stopped early: {rec.error}",
                           err=True)


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
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="What if: override a config key for the re-simulation. Repeatable.")
@click.option("--trace", "out", metavar="OUT",
              help="Write the re-simulated trace here (with --set, the default is a new "
                   "file in the trace directory).")
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
    click.echo(f"re-simulated {result.num_steps} steps ({result.num_recorded_steps} recorded)"
               + (f" with {changed}" if changed else " with the recorded config"))
    if result.divergence is None:
        click.echo("every decision reproduced" if not overrides
                   else "the change alters no decision")
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
    """Throughput, TTFT/TPOT percentiles, preemptions, prefix hits and KV use of a trace."""
    import json

    from replays.stats import format_stats, trace_stats

    s = trace_stats(trace)
    click.echo(json.dumps(s.to_json(), indent=1) if as_json else format_stats(s))


@main.command()
@click.argument("trace")
@click.argument("predicates", nargs=-1, required=True, metavar="PREDICATE...")
@click.option("--from", "start", type=int, default=None,
              help="Search from this step (default: the start, or the end with --backward).")
@click.option("--backward", is_flag=True, help="Find the previous hit instead of the next.")
@click.option("--all", "every", is_flag=True, help="List every step where one holds.")
@user_errors
def find(trace: str, predicates: tuple[str, ...], start: int | None, backward: bool,
         every: bool) -> None:
    """Find the steps where breakpoints hold (the TUI's n/N, from the shell).

    Predicates: preempt, preempt:ID, admit:ID, first-token:ID, finish:ID, free<N, slow>MS,
    wait>STEPS, util<PERCENT. Exit status 1 when nothing matches."""
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
            origin = start if start is not None else (
                tl.last_step + 1 if backward else tl.first_step - 1)
            hit = find_step(tl, preds, origin, backward=backward)
            hits = [] if hit is None else [hit]
    for step in hits:
        click.echo(str(step))
    if not hits:
        click.echo("no step matches", err=True)
        sys.exit(1)


@main.command()
@click.argument("trace", metavar="TRACE")
@click.option("--perfetto", "out", required=True, metavar="OUT.json",
              help="Write the Chrome trace-event format, for ui.perfetto.dev or "
                   "chrome://tracing.")
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
    click.echo(f"perfetto: {done.events} events ({done.steps} steps, {done.requests} "
               f"requests, {done.preemptions} preemptions) -> {done.path}")


if __name__ == "__main__":
    main()
