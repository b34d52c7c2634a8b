"""Small builders shared by the tests."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.core import EngineCore, StepResult
from engine.records import Snapshot, Step
from engine.sim.driver import make_engine, run_steps
from engine.sim.workload import SimWorkload, parse_workload
from recorder.reader import TraceReader

ROOT = Path(__file__).resolve().parent.parent


def workload(requests: list[dict[str, Any]], **config: Any) -> SimWorkload:
    base = dict(
        block_size=16,
        num_blocks=1000,
        max_num_batched_tokens=512,
        max_num_seqs=16,
        max_model_len=8192,
        policy="fcfs",
        enable_prefix_caching=True,
    )
    base.update(config)
    return parse_workload({"config": base, "requests": requests}, source="test")


def req(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    arrival_step: int = 0,
    base: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    """A request whose prompt is `prompt_len` distinct tokens starting at `base`; without
    one, at a start fixed by the id (a stable hash: Python's own str hash changes with
    every process, and once in a thousand runs gave two ids the same prompt, whose prefix
    hit then undid what a test set up)."""
    start = base or (zlib.crc32(rid.encode()) % 1000) * 10_000
    return dict(
        id=rid,
        prompt_token_ids=list(range(start, start + prompt_len)),
        output_token_ids=list(range(7, 7 + max_tokens)),
        max_tokens=max_tokens,
        arrival_step=arrival_step,
        **extra,
    )


def run(w: SimWorkload, check: bool = True) -> tuple[list[StepResult], EngineCore]:
    """Simulate `w` to the end; with `check`, verify the KV invariants after every step."""
    engine = make_engine(w)
    results = []
    for result in run_steps(w, engine):
        if check:
            engine.scheduler.kv.check_invariants()
        results.append(result)
    return results, engine


def waiting(result: StepResult) -> list[str]:
    """The waiting queue at the end of the step, by request id."""
    return [result.names[r] for r in result.report.waiting or ()]


def scheduled(result: StepResult) -> dict[str, int]:
    names = result.names
    return {names[s.ref]: s.num_tokens for s in result.report.scheduled}


@dataclass
class Recorded:
    """A simulation recorded while it ran."""

    recorder: Any  # the Recorder
    engine: EngineCore
    states: list[Snapshot] = field(default_factory=list)  # the engine's, after each step
    reports: list[Step] = field(default_factory=list)  # every step's report
    results: list[StepResult] = field(default_factory=list)  # every step's result

    @property
    def data(self) -> bytes:
        return bytes(self.recorder.sink.data)


def record(w: SimWorkload, sink: Any = None, **options: Any) -> Recorded:
    """Simulate `w` while recording it (into memory by default)."""
    from recorder.recorder import Recorder, RecorderOptions
    from recorder.writer import MemoryWriter

    engine = make_engine(w)
    # Strict (a recorder bug fails the test) unless recording in the background, where
    # errors cannot raise on the engine's thread.
    options.setdefault("strict", not options.get("background", False))
    recorder = Recorder(
        engine, sink if sink is not None else MemoryWriter(), RecorderOptions(**options)
    )
    out = Recorded(recorder, engine)
    for result in run_steps(w, engine):
        out.states.append(engine.snapshot())
        out.reports.append(result.report)
        out.results.append(result)
    engine.close()
    return out


_OPENED: list[TraceReader] = []  # readers opened by open_reader, closed after each test


def open_reader(path: Path) -> TraceReader:
    """A TraceReader that conftest closes when the test ends (for tests that hand a reader
    to a Timeline or Session and never see it again)."""
    return close_later(TraceReader(path))


def close_later(reader: TraceReader) -> TraceReader:
    """`reader`, to be closed by conftest when the test ends."""
    _OPENED.append(reader)
    return reader


def close_readers() -> None:
    while _OPENED:
        _OPENED.pop().close()


def write_trace(tmp_path: Path, data: bytes | bytearray, name: str = "t.trace") -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def engine_python(engine: str, maker: str) -> str:
    """The interpreter of the venv an engine's tests run in (`engine`: "vLLM", "SGLang"):
    $SCHEDTOP_<ENGINE>_PYTHON, else .venv-<engine> at the top of the checkout, which
    `maker` makes. Skips the test without one; fails it in CI, which must run them."""
    name = engine.lower()
    configured = os.environ.get(f"SCHEDTOP_{name.upper()}_PYTHON")
    python = configured or str(ROOT / f".venv-{name}" / "bin" / "python")
    if Path(python).exists():
        return python
    why = f"no {engine} venv ({python} does not exist; {maker} makes one)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI must run the {name} tests: {why}")
    pytest.skip(why)
