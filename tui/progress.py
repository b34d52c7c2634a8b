"""Progress on stderr (stdout stays the summary): a spinner while the model loads, the
requests of `schedtop run`, the tasks of `schedtop sweep`."""

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


class SweepProgress:
    """A progress bar on stderr while a sweep runs, when stderr is a terminal: entering
    gives the callback (done, total) or None."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar: Progress | None = None

    def __enter__(self) -> Callable[[int, int], None] | None:
        import sys

        if not sys.stderr.isatty():
            return None
        bar = self.bar = Progress(console=Console(stderr=True), transient=True)
        bar.start()
        task = bar.add_task("sweep", total=self.total)
        return lambda done, total: bar.update(task, completed=done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
