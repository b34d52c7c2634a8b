"""The terminal UI's commands: `live` (follow a trace or a server), `replay` (a recorded
trace as a debugger), `demo` (an engine in the background, shown live), and `schedtop`
alone (attach to the newest trace)."""

from __future__ import annotations

import sys

import click

from tui.cli.common import fail, user_errors


@user_errors
def attach() -> None:
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


@click.command()
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


@click.command()
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
@click.option(
    "--rank",
    type=click.IntRange(min=0),
    metavar="R",
    help="A directory of data-parallel rank traces: replay rank R (default: the first).",
)
@user_errors
def replay(trace: str, breaks: tuple[str, ...], rank: int | None) -> None:
    """Step through a recorded trace like a debugger, from step 0: forwards, backwards,
    to any step or time, to the next breakpoint hit. Keys: ? in the app. A directory of
    one vLLM recording's data-parallel rank traces: one rank, with a note naming the others."""
    from replays.breakpoints import parse
    from replays.ranks import find_ranks, pick_rank, rank_note
    from tui.launch import open_session, run_app

    try:
        predicates = tuple(parse(b) for b in breaks)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--break") from None
    # A breakpoint on a request the trace does not have is refused by the app once its
    # incident scan has read the trace (checking here would read it all before opening).
    ranks = find_ranks(trace)
    if ranks is None:
        if rank is not None:
            raise click.BadParameter(
                "only for a directory of data-parallel rank traces", param_hint="--rank"
            )
        run_app(open_session(trace, live=False, breakpoints=predicates))
        return
    # One rank at a time: each is its own scheduler, with its own steps and clock.
    chosen = pick_rank(ranks, rank)
    session = open_session(chosen.path, live=False, breakpoints=predicates)
    if len(ranks) > 1:
        session.notices.append(("information", rank_note(ranks, chosen.rank, trace)))
    run_app(session)


@click.command()
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
    from tui.demo import DEFAULT_PACE, DemoError, Engine, follow_headless
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
    except DemoError as e:  # the engine failed: not a mistake in the input (status 1)
        fail(e, 1)
    finally:
        engine.stop()
    click.echo(f"trace: {engine.path}  (replay it: schedtop replay {engine.path})")


COMMANDS = (live, replay, demo)
