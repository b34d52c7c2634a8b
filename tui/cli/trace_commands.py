"""The commands on a recorded trace: `info`, `resim`, `whatif`, `sweep`, `diff`, `stats`,
`find` and `export`. Each calls one function of recorder or replays and prints what it
returns with the formatter that lives beside that result's type."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from tui.cli.common import FORCE, check_outputs, set_option, user_errors

MIN_R2 = click.option(
    "--min-r2",
    type=click.FloatRange(max=1.0),
    metavar="R2",
    help="Refuse to predict with a fitted step-time model whose R² on held-out steps is below R2.",
)
GROUP_BY = click.option(
    "--group-by",
    "group_by",
    metavar="prio|tenant|REGEX",
    help="Also each group's figures: by priority (prio), by tenant (a workload's tenant, "
    "a client's user), or by a regular expression's match in the request id (its first "
    "group, else the whole match).",
)
STRICT = click.option(
    "--strict",
    is_flag=True,
    help="Refuse a fitted step-time model below the trust threshold (--min-r2 0.5).",
)


@click.command()
@click.argument("trace", metavar="TRACE")
@user_errors
def info(trace: str) -> None:
    """Show what a trace holds: header, steps, duration, requests, preemptions, and
    whether it was closed cleanly (or where its tail was cut). A directory of one
    recording's data-parallel rank traces: the ranks side by side."""
    from recorder.info import format_summary, summarize
    from replays.ranks import find_ranks
    from replays.ranks import format_info as format_ranks

    ranks = find_ranks(trace)
    if ranks is not None:
        click.echo(format_ranks(ranks, [summarize(r.path) for r in ranks]))
        return
    click.echo(format_summary(summarize(trace)))


# -- replays: re-simulation, diff, stats, breakpoints ------------------------------------------


@click.command()
@click.argument("trace")
@set_option("What if: override a config key for the re-simulation. Repeatable.")
@click.option(
    "--trace",
    "out",
    metavar="OUT",
    help="Write the re-simulated trace here (with --set or --engine vllm, the default "
    "is a new file in the trace directory, never next to TRACE).",
)
@click.option(
    "--engine",
    type=click.Choice(["schedtop", "vllm", "sglang"]),
    default="schedtop",
    show_default=True,
    help="Whose scheduler re-simulates: schedtop's, the installed vLLM's (an interpreter "
    "with vLLM: $SCHEDTOP_VLLM_PYTHON) or SGLang's (an SGLang trace; an interpreter with "
    "SGLang: $SCHEDTOP_SGLANG_PYTHON). schedtop's on an SGLang trace is a cross-engine "
    "what-if.",
)
@GROUP_BY
@FORCE
@user_errors
def resim(
    trace: str,
    settings: tuple[str, ...],
    out: str | None,
    engine: str,
    group_by: str | None,
    force: bool,
) -> None:
    """Re-drive today's scheduler with a trace's inputs.

    With the recorded config every decision must come out the same: exit status 0 when
    it does, 1 at the first step that differs. With --set, compare the new run with the
    recorded one; --group-by compares each group's figures too."""
    from engine.sim.api import parse_settings
    from recorder.paths import new_trace_path
    from replays.diff import diff_traces, format_diff
    from replays.groups import parse_group_by
    from replays.resim import resimulate

    check_outputs({"--trace": out}, [trace], force, out)
    overrides = parse_settings(settings)
    by = parse_group_by(group_by) if group_by is not None else None
    if engine != "schedtop":
        _resim_engine(engine, trace, overrides, out, force, by)
        return
    if _kv_pool(trace) != "blocks":
        _cross_engine(trace, overrides, out)
        return
    if overrides and out is None:
        path = new_trace_path("resim")
        path.parent.mkdir(parents=True, exist_ok=True)
        out = str(path)
    result = resimulate(trace, overrides, out)
    click.echo(result.format())
    if out is not None:
        click.echo(f"trace: {out}")
    if (overrides or by is not None) and out is not None:
        click.echo("")
        click.echo(format_diff(diff_traces(trace, out, group_by=by)))
    elif by is not None:  # nothing to compare with: the recording's groups
        from replays.stats import format_stat_groups, trace_stats

        click.echo("")
        click.echo(format_stat_groups(trace_stats(trace, by)))
    if result.divergence is not None and not overrides:
        sys.exit(1)


_MODEL_HELP = (
    "The step-time model: a JSON file (schedtop stats --cost-model --json) or "
    "intercept=S,prefill_tokens=S,decode_requests=S,spec_tokens=S,context_tokens=S,"
    "num_requests=S (seconds). Default: fitted on the trace's own timings; a simulated "
    "trace has none and needs one."
)


@click.command()
@click.argument("trace")
@set_option(
    "What if: override a config key. Repeatable. None: predict the recorded run "
    "itself (the model's self-check)."
)
@click.option("--model", "model_spec", metavar="FILE|SPEC", help=_MODEL_HELP)
@click.option(
    "--trace",
    "out",
    metavar="OUT",
    help="Write the predicted trace here (replay, diff, stats, export it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print recorded and predicted as JSON.")
@GROUP_BY
@MIN_R2
@STRICT
@FORCE
@user_errors
def whatif(
    trace: str,
    settings: tuple[str, ...],
    model_spec: str | None,
    out: str | None,
    as_json: bool,
    group_by: str | None,
    min_r2: float | None,
    strict: bool,
    force: bool,
) -> None:
    """Predict a trace's run under another config, in time: arrivals at their recorded
    times, each step as long as the step-time model says. Prints recorded vs predicted."""
    import json

    from engine.sim.api import parse_settings
    from replays.costmodel import TRUST_R2, parse_model, trust_warning
    from replays.groups import parse_group_by
    from replays.whatif import whatif as predict

    inputs: list[str | None] = [
        trace,
        model_spec if model_spec and Path(model_spec).exists() else None,
    ]
    check_outputs({"--trace": out}, inputs, force, out)
    overrides = parse_settings(settings)
    model = parse_model(model_spec) if model_spec else None
    by = parse_group_by(group_by) if group_by is not None else None
    r = predict(trace, overrides, model, out, min_r2=TRUST_R2 if strict else min_r2, group_by=by)
    warning = trust_warning(r.model)
    if warning is not None:
        click.echo(f"schedtop: warning: {warning}", err=True)
    click.echo(json.dumps(r.to_json(), indent=1) if as_json else r.format())
    if out is not None and not as_json:
        click.echo(f"trace: {out}")


@click.command()
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
@MIN_R2
@STRICT
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
    min_r2: float | None,
    strict: bool,
) -> None:
    """Predict every trace under every config of a grid; rank the configs by an objective.

    Exit status 1 when some task failed (its row says why; the others ran)."""
    import json

    from replays import sweep as sw
    from replays.costmodel import TRUST_R2, parse_model
    from tui.progress import SweepProgress

    if as_json and as_csv:
        raise click.UsageError("--json and --csv exclude each other")
    points = sw.parse_grid(grid)
    sw.check_objective(objective)
    model = parse_model(model_spec) if model_spec else None
    tasks = sw.plan(sw.find_traces(traces), points, model, TRUST_R2 if strict else min_r2)
    with SweepProgress(len(tasks)) as progress:
        rows = sw.run_sweep(tasks, "ray" if use_ray else "pool", jobs, progress)
    if as_json:
        click.echo(json.dumps(sw.to_json(rows, objective), indent=1))
    elif as_csv:
        click.echo(sw.to_csv(rows, objective), nl=False)
    else:
        click.echo(sw.format_table(rows, objective))
    shaky = dict.fromkeys(str(r.trace) for r in rows if r.untrusted)
    for name in shaky:
        click.echo(
            f"schedtop: warning: {name}: the step-time model's held-out R² is below "
            f"{TRUST_R2}; its rows are marked ? (--min-r2 or --strict refuse them)",
            err=True,
        )
    failed = [r for r in rows if r.error]
    # One line per distinct error: a refused value fails every trace under it the same way.
    by_error: dict[str, list[Any]] = {}
    for r in failed:
        by_error.setdefault(str(r.error), []).append(r)
    for error, same in by_error.items():
        names = ", ".join(dict.fromkeys(str(r.trace) for r in same))
        configs = ", ".join(dict.fromkeys(str(r.config) for r in same))
        count = f" ({len(same)} tasks)" if len(same) > 1 else ""
        click.echo(f"schedtop: task failed: {names} {configs}{count}: {error}", err=True)
    if failed:
        sys.exit(1)


def _kv_pool(trace: str) -> str:
    """The trace's pool kind; for a trace that cannot be read, "blocks": resimulate
    then says what is wrong with it, as it always has."""
    from recorder.multi import open_trace

    try:
        with open_trace(trace) as reader:
            return reader.header.kv_pool
    except (ValueError, OSError):
        return "blocks"


def _cross_engine(trace: str, overrides: dict[str, Any], out: str | None) -> None:
    """schedtop's scheduler on another engine's trace: a what-if, exit 0 however much
    the decisions differ."""
    from recorder.paths import new_trace_path
    from replays.diff import diff_traces, format_diff
    from replays.resim import cross_engine_whatif

    if out is None:
        path = new_trace_path("resim-cross")
        path.parent.mkdir(parents=True, exist_ok=True)
        out = str(path)
    result = cross_engine_whatif(trace, overrides, out)
    changed = " ".join(f"{k}={v}" for k, v in result.config.to_dict().items() if v is not None)
    click.echo("cross-engine what-if: schedtop's scheduler (vLLM's policy) on this trace's")
    click.echo("requests, prompts and sampled tokens; A is the recording, B schedtop's run;")
    click.echo("decisions compared (when samples arrive and how the pool is counted are")
    click.echo("each engine's own)")
    click.echo(f"config: {changed}")
    click.echo(f"schedtop ran {result.num_steps} steps; trace: {out}")
    click.echo("")
    click.echo(format_diff(diff_traces(trace, out, decisions_only=True)))


def _resim_engine(
    engine: str, trace: str, overrides: dict[str, Any], out: str | None, force: bool, by: Any = None
) -> None:
    from replays.diff import diff_traces, format_diff

    # check_outputs has refused an existing --trace without --force already.
    if engine == "vllm":
        from replays.vllm_resim import resimulate_with_vllm as resimulate_with

        who = "vLLM"
    else:
        from replays.sglang_resim import resimulate_with_sglang as resimulate_with

        who = "SGLang"
    result = resimulate_with(trace, overrides, out, overwrite=force)
    click.echo(f"{who}'s scheduler ran {result.num_steps} steps; trace: {result.trace}")
    if result.reproduced:
        click.echo(
            "every decision reproduced" if not overrides else "the change alters no decision"
        )
        return
    click.echo(f"first difference at step {result.divergence_step}: {', '.join(result.fields)}")
    click.echo("")
    click.echo(format_diff(diff_traces(trace, result.trace, group_by=by)))
    if not overrides:
        sys.exit(1)


@click.command()
@click.argument("a")
@click.argument("b")
@GROUP_BY
@click.option("--json", "as_json", is_flag=True, help="Print the metrics (and groups) as JSON.")
@user_errors
def diff(a: str, b: str, group_by: str | None, as_json: bool) -> None:
    """Compare two traces: the first step whose decisions differ, then metric deltas
    (--group-by: per group too).

    Exit status 0 when the decisions are identical, 1 when they differ, 2 on bad input."""
    import json

    from replays.diff import diff_traces, format_diff
    from replays.groups import parse_group_by

    d = diff_traces(a, b, group_by=parse_group_by(group_by) if group_by is not None else None)
    click.echo(json.dumps(d.to_json(), indent=1) if as_json else format_diff(d))
    sys.exit(0 if d.identical else 1)


@click.command()
@click.argument("trace")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as JSON.")
@click.option(
    "--cost-model",
    is_flag=True,
    help="Instead: fit the step-time model on the trace's recorded step timings and print "
    "it with its fit quality (with --json, the file `whatif --model` reads).",
)
@GROUP_BY
@user_errors
def stats(trace: str, as_json: bool, cost_model: bool, group_by: str | None) -> None:
    """Throughput, TTFT/TPOT percentiles, preemptions, prefix hits and KV use of a trace,
    and its preemption storm: preemptions per 1k steps, recompute lost, top victims. A
    directory of one recording's data-parallel rank traces: the ranks side by side."""
    import json

    from replays.ranks import find_ranks

    ranks = find_ranks(trace)
    if ranks is not None:
        if group_by is not None:  # each rank is its own scheduler: group one rank's trace
            raise click.UsageError("--group-by takes one trace, not a directory of ranks")
        _rank_stats(ranks, as_json, cost_model)
        return
    if cost_model:
        from replays.costmodel import format_model
        from replays.timebase import fit_trace

        m = fit_trace(trace)
        click.echo(json.dumps(m.to_json(), indent=1) if as_json else format_model(m))
        return
    from replays.groups import parse_group_by
    from replays.stats import format_stat_groups, format_stats, trace_stats
    from replays.storms import format_summary, scan

    s = trace_stats(trace, parse_group_by(group_by) if group_by is not None else None)
    storm = scan(trace).summary()
    if as_json:
        click.echo(json.dumps({**s.to_json(), "storm": storm.to_json()}, indent=1))
    else:
        click.echo(f"{format_stats(s)}\n{format_summary(storm)}")
        groups = format_stat_groups(s)
        if groups is not None:
            click.echo(f"\n{groups}")


def _rank_stats(ranks: Any, as_json: bool, cost_model: bool) -> None:
    import json

    from replays import ranks as rk
    from replays.stats import trace_stats
    from replays.storms import scan

    if cost_model:
        raise click.UsageError(
            "--cost-model fits one rank's step timings: give one rank's trace, not the directory"
        )
    stats = [trace_stats(r.path) for r in ranks]
    storms = [scan(r.path).summary() for r in ranks]
    if as_json:
        click.echo(json.dumps(rk.stats_json(ranks, stats, storms), indent=1))
    else:
        click.echo(rk.format_stats(ranks, stats, storms))


@click.command()
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
@click.option(
    "--names", is_flag=True, help="After each step, the requests the hit is about (wait>, preempt)."
)
@user_errors
def find(
    trace: str,
    predicates: tuple[str, ...],
    start: int | None,
    backward: bool,
    every: bool,
    names: bool,
) -> None:
    """Find the steps where breakpoints hold (the TUI's n/N, from the shell).

    Predicates: preempt, preempt:ID, admit:ID, first-token:ID, finish:ID, free<N, slow>MS,
    wait>STEPS, util<PERCENT (conditions hit where they become true), `while COND` (at
    every step it holds). Exit status 1 when nothing matches."""
    from recorder.multi import open_trace
    from recorder.schema import printable
    from replays.breakpoints import about, find_all, parse
    from replays.breakpoints import find as find_step
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
            who = about(tl, preds, step) if names else ()
            click.echo(f"{step}  {' '.join(printable(r) for r in who)}" if who else str(step))
    if not hits:
        # Nothing matched: a predicate on a request the trace does not have is a mistake
        # to name (checked only now: it reads the whole trace).
        _refuse_unknown_requests(trace, preds)
        click.echo("no step matches", err=True)
        sys.exit(1)


@click.command()
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
    click.echo(done.format())


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


COMMANDS = (info, resim, whatif, sweep, diff, stats, find, export)
