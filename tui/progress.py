"""A progress display for `schedtop run`, on stderr so that stdout stays the summary."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def loading(what: str) -> Iterator[None]:
    """A spinner while something slow happens (loading the model)."""
    console = Console(stderr=True)
    with console.status(what):
        yield


@contextlib.contextmanager
def progress_bar(total: int) -> Iterator[Callable[[int, int, int], None]]:
    """Yields a callback (finished, total, output tokens) that moves the bar."""
    columns = (
        TextColumn("requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} output tokens"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("run", total=total, tokens=0)

        def update(done: int, _total: int, tokens: int) -> None:
            bar.update(task, completed=done, tokens=tokens)

        yield update
