"""Suite-wide isolation: no test writes a default trace into the user's ~/.cache, and
the trace readers a test opens with helpers.open_reader are closed after it."""

from __future__ import annotations

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
