"""recorder.vllm builds its KV mirror and events off vLLM's engine thread (issue 28,
item 2): the trace must be the one the engine thread would have written itself."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.test_vllm import find_vllm_python

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kv_events_built_on_the_encoding_thread_make_the_same_trace(
    mode: str, tmp_path: Path
) -> None:
    python = find_vllm_python()
    out = tmp_path / "out.pickle"
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT),
        VLLM_LOGGING_LEVEL="ERROR",
        VLLM_TARGET_DEVICE="cpu",
        # Snapshots on the same steps in both runs (not by their cost, which varies).
        SCHEDTOP_SNAPSHOT_INTERVAL="32",
        SCHEDTOP_SNAPSHOT_BUDGET="0",
    )
    proc = subprocess.run(
        [python, "-m", "tests.vllm_kv_deferred", mode, "32", "200", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = pickle.loads(out.read_bytes())
    deferred, inline = runs["deferred"], runs["inline"]
    assert deferred["stopped"] is None and inline["stopped"] is None
    # The churn load admits and finishes requests, fills and allocates blocks.
    assert len(deferred["records"]) > 200
    assert any(getattr(r, "finishes", ()) for r in deferred["records"])
    assert deferred["records"] == inline["records"]
    # The deferred run left work to the encoding thread at most steps' ends; the inline
    # one only arrivals' (async: added after a step that ended in schedule()).
    assert deferred["left"] > 100 > inline["left"]
