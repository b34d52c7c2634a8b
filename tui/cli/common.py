"""What the command families share: user errors as one line, output paths checked before
any work, attaching a recorder, the config's knobs as flags, and the other flags that
several commands take."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from engine.config import KNOBS, Knob, parse_size

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: object, status: int = 2) -> None:
    """One line on stderr, then exit."""
    click.echo(f"schedtop: error: {message}", err=True)
    sys.exit(status)


def user_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line on stderr and exit status 2. Every
    such error derives from engine.errors.UserError, so this map imports none of the
    packages that raise them (`schedtop sim` stays free of numpy)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from engine.errors import UserError

        try:
            return fn(*args, **kwargs)
        except UserError as e:
            fail(e)
        except OSError as e:  # EIO, EISDIR, ENOSPC...: the file and the reason, one line
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}")

    return wrapper  # type: ignore[return-value]


FORCE = click.option(
    "--force", is_flag=True, help="Overwrite output files that exist (never devices or links)."
)


class _Size(click.ParamType[int]):
    """A byte count as engine.config.parse_size reads it: 4GiB, 512MB, 1.5g, 1048576."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def size_option(flag: str, default: str | None, help: str) -> Callable[[F], F]:
    """A byte-count flag, parsed before the command runs (a bad one is a usage error)."""
    return click.option(
        flag, type=_Size(), metavar="SIZE", default=default, show_default=bool(default), help=help
    )


def seconds_option(flag: str, default: float, help: str, zero: bool = False) -> Callable[[F], F]:
    """A duration flag in seconds: > 0, or >= 0 where `zero` means something."""
    return click.option(
        flag,
        type=click.FloatRange(min=0, min_open=not zero),
        default=default,
        show_default=True,
        metavar="SECONDS",
        help=help,
    )


def trace_switches(fn: F) -> F:
    """--no-trace and --redact-prompts: the same two switches on every command that
    records (sim, run, serve), said the same way."""
    fn = click.option(
        "--redact-prompts",
        is_flag=True,
        help="Leave prompt and sampled token ids out of the trace (lengths and block hashes stay).",
    )(fn)
    return click.option("--no-trace", is_flag=True, help="Do not record a trace.")(fn)


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


def about(w: Any) -> str:
    """The workload line of a summary; its description is the file's, so made printable."""
    from engine.records import printable

    return printable(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))


class Recording:
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
                fail(f"recording stopped early: {rec.error}", 1)


def set_option(help: str) -> Callable[[F], F]:
    """`--set KEY=VALUE`, repeatable, into the command's `settings`."""
    return click.option("--set", "settings", multiple=True, metavar="KEY=VALUE", help=help)


def knob_options(*owners: str) -> Callable[[F], F]:
    """The flags of the knobs of `owners` ("engine", "runner") that `run` takes, with
    their vLLM spellings, derived from engine.config. Every flag defaults to None (not
    given), so that a workload file's value stands unless the flag overrides it."""

    def decorate(fn: F) -> F:
        chosen = [k for k in KNOBS.values() if k.owner in owners and k.flag and k.run_key]
        for k in reversed(chosen):
            fn = _option(k)(fn)
        return fn

    return decorate


def _option(k: Knob) -> Callable[[F], F]:
    assert k.flag is not None  # knob_options passes flagged knobs only
    help = f"{k.help} [default: {k.shown_default}]"
    if k.type is bool:
        flags = f"{k.flag}/--no-{k.flag.removeprefix('--')}"
        return click.option(flags, k.name, default=None, help=help)
    if k.choices:
        return click.option(k.flag, k.name, type=click.Choice(k.choices), help=help)
    if k.type in (int, float) and k.name != "kv_cache_memory":
        return click.option(k.flag, k.name, type=k.type, help=help)
    metavar = {"kv_cache_memory": "SIZE", "speculative_config": "JSON"}.get(k.name, "TEXT")
    return click.option(k.flag, k.name, metavar=metavar, help=help)
