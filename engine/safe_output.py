"""The one rule set for every file a command writes (`--trace`, `--decisions`, `--outputs`,
`--perfetto`, resim's `--trace`), checked before any work so that a bad path costs nothing
and never destroys data:

- an empty path is refused;
- an output that names one of the command's inputs (or another of its outputs) is refused,
  whichever spelling or link names it;
- a dangling symlink, and anything that is not a regular file (a device, a FIFO, a
  directory), is refused: writing there would replace it or block;
- an existing regular file is refused unless `force` (the `--force` flag);
- the parent directory must exist and be writable.

Files are then written atomically by their writers (a temporary file renamed over the
target), except a trace, which a live reader follows while it grows and which its writer
locks instead. This module is stdlib only: every layer may use it."""

from __future__ import annotations

import glob
import os
import stat
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError


class OutputError(UserError):
    """An output path that a command refuses to write; the message names the path."""


@dataclass(frozen=True)
class Output:
    """One file a command is about to write."""

    option: str  # the option that names it, for the message ("--decisions")
    path: str  # as the user spelled it


def check_outputs(
    outputs: Iterable[Output], inputs: Iterable[str | os.PathLike[str]], *, force: bool
) -> None:
    """Raise OutputError for the first output the rules above refuse."""
    seen: list[tuple[Output, Path]] = []
    ins = [Path(p) for p in inputs]
    for out in outputs:
        target = check_output(out, ins, force=force)
        for other, other_target in seen:
            if target == other_target:
                raise OutputError(f"{out.option} {out.path}: is also {other.option}")
        seen.append((out, target))


def check_output(out: Output, inputs: Iterable[Path], *, force: bool) -> Path:
    """The checked path the output will be written to (links resolved)."""
    if not out.path.strip():
        raise OutputError(f"{out.option}: empty path")
    path = Path(out.path)
    target = Path(os.path.realpath(path))
    for p in inputs:
        if _same(target, p):
            raise OutputError(
                f"{out.option} {out.path}: is the input {p}; writing it would destroy "
                "the input, choose another output"
            )
    if path.is_symlink() and not target.exists():
        raise OutputError(f"{out.option} {out.path}: is a dangling symlink; refusing to follow it")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{out.option} {out.path}: cannot check: {e.strerror or e}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(
                f"{out.option} {out.path}: is not a regular file (a device, FIFO or "
                "directory); refusing to replace it"
            )
        if not force:
            raise OutputError(f"{out.option} {out.path}: exists; pass --force to overwrite it")
    parent = target.parent
    if not parent.is_dir():
        raise OutputError(f"{out.option} {out.path}: cannot write: no directory {parent}")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{out.option} {out.path}: cannot write: {parent} is not writable")
    return target


def _same(target: Path, other: Path) -> bool:
    if target == Path(os.path.realpath(other)):
        return True
    try:
        return target.exists() and other.exists() and os.path.samefile(target, other)
    except OSError:
        return False


def remove_stale_temps(final: Path) -> None:
    """Remove `.NAME.PID[.X].tmp` files next to `final` whose writer is dead: a writer
    killed by SIGKILL cannot clean up after itself, so the next one does."""
    for tmp in final.parent.glob(f".{glob.escape(final.name)}.*.tmp"):
        parts = tmp.name[len(final.name) + 2 : -len(".tmp")].split(".")
        if parts and parts[0].isdigit() and not _alive(int(parts[0])):
            with suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
