"""The environment of a vLLM recording kept as a server's (recorder.vllm.live): off by
default, one line per mistake, and refused before vLLM loads the model (the plugin)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recorder.errors import RecordingError
from recorder.vllm.live import live_port_asked, settings
from recorder.vllm.plugin import early_problems


def test_off_by_default() -> None:
    s = settings({})
    assert not s.segmented and s.live_port is None and s.max_bytes is None
    assert not live_port_asked({})


def test_a_bound_or_a_port_records_into_segments() -> None:
    s = settings({"SCHEDTOP_TRACE_MAX_BYTES": "1GiB", "SCHEDTOP_INCIDENT_MAX_BYTES": "100MiB"})
    assert s.segmented and s.max_bytes == 1 << 30 and s.incident_max_bytes == 100 << 20
    s = settings({"SCHEDTOP_LIVE_PORT": "7000", "SCHEDTOP_LIVE_API_KEY": "k"})
    assert s.segmented and s.live_port == 7000 and s.api_key == "k" and s.max_bytes is None
    assert live_port_asked({"SCHEDTOP_LIVE_PORT": "7000"})
    assert settings({"SCHEDTOP_TRACE_KEEP_RUNS": "3", "SCHEDTOP_LIVE_PORT": "1"}).keep_runs == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SCHEDTOP_TRACE_MAX_BYTES": "lots"}, "SCHEDTOP_TRACE_MAX_BYTES: 'lots': expected a size"),
        ({"SCHEDTOP_LIVE_PORT": "70000"}, "SCHEDTOP_LIVE_PORT=70000: must be in 1..65535"),
        ({"SCHEDTOP_LIVE_PORT": "x"}, "SCHEDTOP_LIVE_PORT='x': expected a whole number"),
        ({"SCHEDTOP_LIVE_PORT": "1", "SCHEDTOP_LIVE_API_KEY": " "}, "SCHEDTOP_LIVE_API_KEY: empty"),
        ({"SCHEDTOP_INCIDENT_MAX_BYTES": "1MiB"}, "needs SCHEDTOP_TRACE_MAX_BYTES"),
        ({"SCHEDTOP_INCIDENT_WINDOW_S": "0"}, "SCHEDTOP_INCIDENT_WINDOW_S=0: must be"),
        (
            {"SCHEDTOP_TRACE_MAX_BYTES": "1GiB", "SCHEDTOP_TRACE_FILE": "/tmp/t.trace"},
            "SCHEDTOP_TRACE_FILE names one file, which cannot rotate",
        ),
    ],
)
def test_mistakes_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(RecordingError) as e:
        settings(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_plugin_refuses_them_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SCHEDTOP_TRACE_FILE", raising=False)
    monkeypatch.setenv("SCHEDTOP_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("SCHEDTOP_LIVE_PORT", "0")
    assert early_problems("0.33.0") == ["SCHEDTOP_LIVE_PORT=0: must be in 1..65535"]
