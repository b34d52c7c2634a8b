"""Suite-wide isolation: no test writes a default trace into the user's ~/.cache (nor
compiles the C attention kernel there), and the trace readers a test opens with
helpers.open_reader are closed after it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import close_readers


@pytest.fixture(autouse=True)
def trace_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default trace directory for this test, not created yet. Outside tmp_path, so
    that tests which check what a command left in tmp_path see only that."""
    directory = tmp_path_factory.mktemp("trace-dir") / "traces"
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(directory))
    return directory


@pytest.fixture(autouse=True)
def _close_opened_readers() -> Iterator[None]:
    yield
    close_readers()


def pytest_configure(config: pytest.Config) -> None:
    """The C attention kernel is compiled once per test run, into a temporary directory
    instead of the user's cache; set before collection, since test modules may build it
    at import, and inherited by child processes."""
    directory = tempfile.mkdtemp(prefix="schedtop-kernels-")
    config.stash[_KERNELS] = (directory, os.environ.get("SCHEDTOP_KERNEL_CACHE"))
    os.environ["SCHEDTOP_KERNEL_CACHE"] = directory


def pytest_unconfigure(config: pytest.Config) -> None:
    directory, previous = config.stash[_KERNELS]
    shutil.rmtree(directory, ignore_errors=True)
    if previous is None:
        os.environ.pop("SCHEDTOP_KERNEL_CACHE", None)
    else:
        os.environ["SCHEDTOP_KERNEL_CACHE"] = previous


_KERNELS = pytest.StashKey[tuple[str, "str | None"]]()
