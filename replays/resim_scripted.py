"""The scripted re-simulation runner: for overrides, redacted traces, or after a
divergence. It reads the whole trace first into per-request scripts (tokens,
acceptances, aborts, and for redacted traces the recorded block hashes), then runs like
`schedtop sim`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from recorder.multi import open_trace
from recorder.reader import TraceReader
from replays.resim_base import (
    Checker,
    Divergence,
    ResimError,
    ResimResult,
    is_mid_step_abort,
    recorder_for,
    request_of,
)
from replays.run_end import run_is_over
from replays.scripts import (
    RecordedHasher,
    RequestScript,
    ScriptedRunner,
    collect_scripts,
    fill_redacted,
)


def run_scripted(
    reader: TraceReader, config: EngineConfig, overrides: dict[str, Any], out: str | Path | None
) -> ResimResult:
    with open_trace(reader.path) as again:
        scripts, num_recorded = collect_scripts(again)
    with open_trace(reader.path) as recorded:  # compared step by step as the run goes
        checker = Checker(recorded.steps())
        return _run(reader, config, overrides, out, scripts, num_recorded, checker)


def _run(
    reader: TraceReader,
    config: EngineConfig,
    overrides: dict[str, Any],
    out: str | Path | None,
    scripts: list[RequestScript],
    num_recorded: int,
    checker: Checker,
) -> ResimResult:
    runner = ScriptedRunner(config)
    engine = EngineCore(config, runner)
    recorder = recorder_for(engine, reader.header, out, checker)
    plain = BlockHasher(config.block_size)
    by_step: dict[int, list[int]] = {}
    aborts: dict[int, list[int]] = {}
    for ref, s in enumerate(scripts):
        by_step.setdefault(s.arrival_step, []).append(ref)
        if s.abort_step >= 0:
            aborts.setdefault(s.abort_step, []).append(ref)
    for refs in aborts.values():  # as recorded, not by arrival: a later arrival can go first
        refs.sort(key=lambda ref: scripts[ref].abort_order)
    live: dict[str, int] = {}
    last_arrival = max(by_step, default=-1)
    limit = 10 * num_recorded + 10_000
    step = 0
    try:
        sched = engine.scheduler
        # A check of a recording that ended before its run (killed, or stopped by the
        # recorder) ends where it does; a what-if run goes on to finish its requests.
        footer = reader.footer
        ended_early = not overrides and (footer is None or bool(footer.stopped))
        while not run_is_over(
            step,
            last_arrival,
            num_recorded,
            sched.has_unfinished(),
            bool(engine.batches),
            ended_early,
        ):
            if step >= limit:
                raise ResimError(f"the re-simulation is still running at step {step}")
            for ref in by_step.get(step, ()):
                s = scripts[ref]
                a = s.arrival
                tokens = fill_redacted(s) if reader.header.redacted else s.tokens
                runner.add(s, tokens)
                live[a.request_id] = ref
                hasher = (
                    RecordedHasher(config.block_size, s, ref) if reader.header.redacted else plain
                )
                engine.add_request(request_of(a, hasher))
            # After the arrivals: a request can arrive and be aborted before one step.
            _abort(engine, scripts, aborts.get(step, ()), live, mid_step=False)
            engine.step(partial(_abort, engine, scripts, aborts.get(step, ()), live, True))
            engine.take_finished()
            step += 1
        if checker.divergence is None and checker.steps < num_recorded:
            checker.divergence = Divergence(checker.steps, ("steps",), None, None)
    finally:
        recorder.close()
    return ResimResult(
        config,
        overrides,
        num_recorded,
        checker.steps,
        checker.divergence,
        Path(out) if out else None,
        "scripted",
    )


def _abort(
    engine: EngineCore,
    scripts: list[RequestScript],
    refs: Sequence[int],
    live: dict[str, int],
    mid_step: bool,
) -> None:
    for ref in refs:
        s = scripts[ref]
        rid = s.arrival.request_id
        if live.get(rid) == ref and is_mid_step_abort(s.abort_message) == mid_step:
            engine.abort(rid, s.abort_message)
