"""The scripted re-simulation runner: for overrides, redacted traces, or after a
divergence. It reads the whole trace first into per-request scripts (tokens,
acceptances, aborts, and for redacted traces the recorded block hashes), then runs like
`schedtop sim`."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import ROOT_HASH, BlockHasher
from engine.request import Request
from engine.sim.runner import SimRunner
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.schema import Arrival, KVKind, Status
from replays.reducer import apply_with_view
from replays.resim_base import (
    Checker,
    Divergence,
    ResimError,
    ResimResult,
    is_mid_step_abort,
    recorded_proposals,
    recorder_for,
    request_of,
)
from replays.state import State


@dataclass
class _Script:
    """Everything the trace says about one request."""

    arrival: Arrival  # how it arrived
    arrival_step: int  # when
    tokens: list[int] = field(default_factory=list)  # every token it sampled, in order
    accepted: dict[int, int] = field(default_factory=dict)  # output position -> drafts accepted
    proposed: dict[int, int] = field(default_factory=dict)  # output position -> drafts proposed
    status: int = 0  # how it finished (0: it had not when the trace ended)
    abort_step: int = -1  # the step whose record reports its abort
    abort_message: str = ""  # its finish's message (says when a mid-step abort came)
    abort_order: int = 0  # its place among that step's finishes: aborts free blocks in order
    hashes: dict[int, bytes] = field(default_factory=dict)  # block index -> recorded hash


def _collect(reader: TraceReader) -> tuple[list[_Script], int]:
    """Read the whole trace into per-request scripts (by ref); also the number of steps."""
    scripts: list[_Script] = []
    tables: dict[int, list[int]] = {}
    state = State.initial(reader.header)
    steps = 0
    for rec in reader.steps():
        steps += 1
        for a in rec.arrivals:
            scripts.append(_Script(a, rec.step))
        view = apply_with_view(state, rec)
        # Keyed by where the verification started: drafts proposed and then dropped (a
        # preemption, a budget that left no room for them) must not shift the rest.
        for acc in rec.spec_accepted:
            scripts[acc.ref].accepted[len(scripts[acc.ref].tokens)] = acc.accepted
        for sample in view.samples:
            script = scripts[sample.ref]
            script.tokens += (
                list(sample.token_ids) if sample.token_ids is not None else [-1] * sample.count
            )  # redacted: filled in later
        for prop in rec.spec_proposed:
            scripts[prop.ref].proposed[len(scripts[prop.ref].tokens)] = prop.count
        for i, f in enumerate(rec.finishes):
            scripts[f.ref].status = f.status
            if f.status == Status.FINISHED_ABORTED:
                scripts[f.ref].abort_step = rec.step
                scripts[f.ref].abort_message = f.message
                scripts[f.ref].abort_order = i
        for e in view.kv_events:
            if e.ref is None:
                continue
            table = tables.setdefault(e.ref, [])
            if e.kind in (KVKind.ALLOCATED, KVKind.PREFIX_HIT):
                table += e.block_ids
            elif e.kind == KVKind.FREED:
                table.clear()
            elif e.kind == KVKind.CACHED:
                for b, h in zip(e.block_ids, e.hashes):
                    scripts[e.ref].hashes[table.index(b)] = h
    return scripts, steps


def _fill_redacted(script: _Script) -> list[int]:
    """Tokens for a redacted request: neither its EOS nor a stop token, except the last
    one when the request stopped on one."""
    a = script.arrival
    stops = set(a.sampling.stop_token_ids)
    if a.eos_token_id is not None:
        stops.add(a.eos_token_id)
    filler = next(t for t in range(len(stops) + 1) if t not in stops)
    tokens = [filler] * len(script.tokens)
    if tokens and script.status == Status.FINISHED_STOPPED and stops:
        last = (
            a.eos_token_id
            if a.eos_token_id is not None and not a.sampling.ignore_eos
            else min(a.sampling.stop_token_ids)
        )
        tokens[-1] = last
    return tokens


class _RecordedHasher:
    """Block hashes for a redacted request: the recorded ones where the trace has them
    (prompt blocks, and every block the request got cached), stand-ins elsewhere."""

    def __init__(self, block_size: int, script: _Script, ref: int) -> None:
        self.block_size = block_size
        self.known = dict(script.hashes)
        for i, h in enumerate(script.arrival.prompt_block_hashes or ()):
            self.known.setdefault(i, h)
        self.salt = struct.pack("<Q", ref)

    def __call__(self, request: Request) -> None:
        hashes = request.block_hashes
        while (len(hashes) + 1) * self.block_size <= len(request.all_token_ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            h = self.known.get(i)
            if h is None:
                h = hashlib.sha256(parent + b"resim" + self.salt).digest()
            hashes.append(h)


class _ScriptedRunner(SimRunner):
    """SimRunner with recorded acceptances: a verification that starts at a request's
    output position accepts what the trace's verification there accepted."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__({}, num_speculative_tokens=config.num_speculative_tokens)
        self.accepted: dict[str, dict[int, int]] = {}  # request -> output position -> accepted
        self.proposed: dict[str, dict[int, int]] = {}  # request -> output position -> proposed
        self.recorded_proposals = recorded_proposals(config)
        self.model_description = ""

    def _propose(self, rid: str) -> list[int]:
        pos = self.sampled[rid]
        right = self.accepted.get(rid, {}).get(pos, 0)
        if self.recorded_proposals:
            n = self.proposed.get(rid, {}).get(pos, 0)
            return [self._token(rid, pos + j) + (0 if j < right else 1) for j in range(n)]
        return [self._token(rid, pos + j) + (0 if j < right else 1) for j in range(self.k)]


def run_scripted(
    reader: TraceReader, config: EngineConfig, overrides: dict[str, Any], out: str | Path | None
) -> ResimResult:
    with open_trace(reader.path) as again:
        scripts, num_recorded = _collect(again)
    with open_trace(reader.path) as recorded:  # compared step by step as the run goes
        checker = Checker(recorded.steps())
        return _run(reader, config, overrides, out, scripts, num_recorded, checker)


def _run(
    reader: TraceReader,
    config: EngineConfig,
    overrides: dict[str, Any],
    out: str | Path | None,
    scripts: list[_Script],
    num_recorded: int,
    checker: Checker,
) -> ResimResult:
    runner = _ScriptedRunner(config)
    engine = EngineCore(config, runner)
    recorder = recorder_for(engine, reader, out, checker)
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
        while step <= last_arrival or engine.has_unfinished():
            if step >= limit:
                raise ResimError(f"the re-simulation is still running at step {step}")
            for ref in by_step.get(step, ()):
                s = scripts[ref]
                a = s.arrival
                tokens = _fill_redacted(s) if reader.header.redacted else s.tokens
                runner.add_script(a.request_id, tokens)
                runner.accepted[a.request_id] = s.accepted
                runner.proposed[a.request_id] = s.proposed
                live[a.request_id] = ref
                hasher = (
                    _RecordedHasher(config.block_size, s, ref) if reader.header.redacted else plain
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
    scripts: list[_Script],
    refs: Sequence[int],
    live: dict[str, int],
    mid_step: bool,
) -> None:
    for ref in refs:
        s = scripts[ref]
        rid = s.arrival.request_id
        if live.get(rid) == ref and is_mid_step_abort(s.abort_message) == mid_step:
            engine.abort(rid, s.abort_message)
