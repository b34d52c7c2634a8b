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

        try:
            return fn(*args, **kwargs)
        except WorkloadError as e:
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
@user_errors
def sim(workload: str | None, settings: tuple[str, ...], decisions: str | None) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload."""
    from engine.sim.api import load, run_sim
    from engine.sim.summary import format_summary

    w = load(workload, settings)
    summary = run_sim(w, decisions)
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))


if __name__ == "__main__":
    main()
