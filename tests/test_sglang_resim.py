"""`resim` on an SGLang trace without SGLang (issue 29): schedtop's scheduler on it is a
cross-engine what-if (compared, exit 0); `--engine sglang`'s refusals that need no SGLang.
The trace is one tests/test_sglang.py recorded in SGLang 0.5.23's real engine: eight
requests decoding 40 tokens each with SGLANG_TEST_RETRACT=1, 19 retractions (SGLang's
scheduler itself re-simulates it in tests/test_sglang.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from recorder.reader import TraceReader
from replays.diff import diff_traces
from replays.resim import ResimError, cross_engine_whatif, resimulate
from tui.cli import main

DATA = Path(__file__).resolve().parent / "data"
TRACE = DATA / "sglang_retract.trace"
SCHEDTOP_TRACE = Path(__file__).resolve().parent.parent / "replays/incidents/watermark_on.trace"


def test_schedtop_on_an_sglang_trace_is_a_cross_engine_whatif(tmp_path: Path) -> None:
    out = tmp_path / "cross.trace"
    result = CliRunner().invoke(main, ["resim", str(TRACE), "--trace", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("cross-engine what-if: schedtop's scheduler")
    assert "first difference at step" in result.output
    assert any(line.startswith("preemptions") and "-19" in line for line in lines)
    with TraceReader(out) as reader:
        assert reader.header.kv_pool == "blocks" and reader.header.block_size == 1
        steps = list(reader.steps())
        # vLLM's policy needs no preemption where SGLang's test knob retracted 19 times
        assert not any(s.preemptions for s in steps)
        assert sum(len(s.finishes) for s in steps) == 8


def test_the_whatif_compares_decisions_not_bookkeeping(tmp_path: Path) -> None:
    out = tmp_path / "cross.trace"
    cross_engine_whatif(TRACE, {}, out)
    everything = diff_traces(TRACE, out)
    decisions = diff_traces(TRACE, out, decisions_only=True)
    # samples a step late under SGLang's overlap loop, a pool counted in slots there
    assert "sampled_tokens" in everything.fields or "free_blocks" in everything.fields
    assert decisions.first_step is not None and decisions.first_step >= everything.first_step
    assert not {"sampled_tokens", "free_blocks", "free_slots"} & set(decisions.fields)


def test_the_whatif_takes_settings_for_schedtops_side(tmp_path: Path) -> None:
    out = tmp_path / "cross.trace"
    r = CliRunner().invoke(
        main, ["resim", str(TRACE), "--set", "num_blocks=300", "--trace", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "num_blocks=300" in r.output
    with TraceReader(out) as reader:
        assert any(s.preemptions for s in reader.steps()), "a pool of 299 blocks preempts"


def test_resimulate_itself_refuses_an_sglang_trace() -> None:
    with pytest.raises(ResimError, match="what-if"):
        resimulate(TRACE)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["resim", str(SCHEDTOP_TRACE), "--engine", "sglang"], "re-simulates SGLang's traces"),
        (["resim", str(TRACE), "--engine", "sglang", "--set", "max_num_seqs=4"], "no --set"),
    ],
)
def test_engine_sglang_refusals(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_engine_sglang_without_an_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCHEDTOP_SGLANG_PYTHON", "/nonexistent/python")
    result = CliRunner().invoke(main, ["resim", str(TRACE), "--engine", "sglang"])
    assert result.exit_code == 2
    assert "SCHEDTOP_SGLANG_PYTHON=/nonexistent/python: no such interpreter" in result.output
