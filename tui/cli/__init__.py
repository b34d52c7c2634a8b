"""The `schedtop` command: the one place where the packages are wired together.

Each subcommand parses its options and calls one library function. The commands come in
three families, one module each: `engine_commands` (run, sim, serve: the engine),
`trace_commands` (info, resim, whatif, sweep, diff, stats, find, export: a recorded trace)
and `app_commands` (live, replay, demo, and no command: the terminal UI); `common` holds what
they share (user errors, output checks, recording, the config's flags). Heavy modules
(torch, textual, the model) are imported inside the subcommand that needs them, so
`schedtop --help` and `schedtop sim` start fast."""

from __future__ import annotations

import click

from tui.cli import app_commands, engine_commands, trace_commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_name="schedtop")
@click.pass_context
def main(ctx: click.Context) -> None:
    """An LLM serving engine that schedules like vLLM V1, with a flight recorder and a
    terminal debugger for what it records.

    Without a command: show the newest trace being written in the trace directory
    ($SCHEDTOP_TRACE_DIR, else ~/.cache/schedtop/traces), live."""
    if ctx.invoked_subcommand is None:
        app_commands.attach()


for _module in (engine_commands, trace_commands, app_commands):
    for _command in _module.COMMANDS:
        main.add_command(_command)
