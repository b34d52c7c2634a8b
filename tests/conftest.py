"""Suite-wide isolation: no test writes a default trace into the user's ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default trace directory for this test: under tmp_path, not created yet."""
    directory = tmp_path / "traces"
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(directory))
    return directory
