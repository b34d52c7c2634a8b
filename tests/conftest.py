"""Suite-wide isolation: no test writes a default trace into the user's ~/.cache."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _private_trace_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests that look inside the trace directory set their own (under tmp_path) after this.
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path_factory.mktemp("traces")))
