"""Re-simulation: drive today's Scheduler with a trace's inputs (DESIGN.md R3).

The trace's arrivals (with their sampling parameters and priorities), its sampled tokens,
its aborts and its speculative-decoding acceptances go through the real scheduler and KV
manager with a model-free runner. With the recorded config every decision must come out
the same; the first step that does not is reported. With `overrides` ("what if the budget
were 1024?") the result is a new trace to compare.

Two runners serve the two cases:
- Faithful (recorded config, token ids recorded): streams the trace once and hands each
  step's recorded samples to the scheduled requests in scheduling order. It reads each
  record once, so it keeps pace with the simulated engine itself.
- Scripted (overrides, redacted traces, or after a divergence): reads the whole trace
  first into per-request scripts (tokens, acceptances, aborts, and for redacted traces the
  recorded block hashes), then runs like `schedtop sim`.

This is the one module of `replays` that imports the engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import ROOT_HASH, BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, SamplingParams
from engine.sim.runner import SimRunner
from recorder.multi import open_trace
from recorder.reader import TraceReader
from recorder.recorder import Recorder
from recorder.schema import Arrival, KVKind, Status, Step
from recorder.writer import NullWriter, TraceWriter
from replays.diff import differing_fields
from replays.reducer import apply_with_view
from replays.state import State

_DRIVER_KEYS = ("max_steps", "async_scheduling")


class ResimError(ValueError):
    """A trace that cannot be re-simulated, or overrides that do not make a valid config."""


@dataclass(frozen=True)
class Divergence:
    """The first step where the re-simulation decided differently from the trace."""

    step: int  # the step
    fields: tuple[str, ...]  # which parts of the step record differ
    recorded: Step | None  # the trace's record (None: the trace had no such step)
    resimulated: Step | None  # the re-simulation's (None: it ended before this step)


@dataclass
class ResimResult:
    """What a re-simulation did."""

    config: EngineConfig  # the config it ran with
    changed: dict[str, Any]  # the overrides applied to the recorded config
    num_recorded_steps: int  # steps in the trace
    num_steps: int  # steps the re-simulation ran
    divergence: Divergence | None  # the first differing step; None: identical decisions
    trace: Path | None  # where the new trace went, if anywhere
    mode: str  # "faithful" or "scripted"

    @property
    def reproduced(self) -> bool:
        return self.divergence is None


def resimulate(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    scripted: bool = False,
    max_steps: int | None = None,
) -> ResimResult:
    """Re-simulate the trace at `path`, with `overrides` applied to its config; write the
    new trace to `out` if given. `scripted` skips the faithful runner (tests use it);
    `max_steps` stops a faithful re-simulation early (benchmarks use it)."""
    with open_trace(path) as reader:
        header = reader.header
        if header.first_step != 0:
            raise ResimError(
                f"{path}: the trace starts mid-run (step {header.first_step}); "
                "re-simulation needs every arrival from step 0"
            )
        config = _config(header.config, overrides or {})
        if not overrides and not header.redacted and not scripted:
            result = _run_faithful(reader, config, out, max_steps)
            if result.reproduced or max_steps is not None:
                return result
        return _run_scripted(reader, config, dict(overrides or {}), out)


def _config(recorded: dict[str, Any], overrides: dict[str, Any]) -> EngineConfig:
    try:
        base = EngineConfig.from_dict(recorded, ignore=_DRIVER_KEYS)
    except (ValueError, TypeError) as e:
        raise ResimError(f"the trace's config is not valid here: {e}") from None
    try:
        return base.replace(**overrides)
    except (ValueError, TypeError) as e:
        raise ResimError(f"--set: {e}") from None


# -- checking steps as they come ----------------------------------------------------------------


class _Checker:
    """Compares each re-simulated step record with the trace's (timings masked). The
    trace's records come from `source`, or are queued with `expect` just before the step
    that should reproduce them."""

    def __init__(self, source: Iterator[Step] | None = None) -> None:
        self.source = source
        self.pending: deque[Step] = deque()
        self.steps = 0
        self.divergence: Divergence | None = None

    def expect(self, rec: Step) -> None:
        self.pending.append(rec)

    def __call__(self, step: Step) -> None:
        self.steps += 1
        if self.divergence is not None:
            return
        if self.pending:
            rec: Step | None = self.pending.popleft()
        else:
            rec = next(self.source, None) if self.source is not None else None
        if rec is None:
            self.divergence = Divergence(step.step, ("steps",), None, step)
            return
        fields = differing_fields(rec, step)
        if fields:
            self.divergence = Divergence(step.step, fields, rec, step)


def _recorder(
    engine: EngineCore, reader: TraceReader, out: str | Path | None, checker: _Checker
) -> Recorder:
    sink = TraceWriter(out, live=False) if out is not None else NullWriter()
    header = reader.header
    return Recorder(
        engine,
        sink,
        redact_prompts=header.redacted,
        snapshot_interval=header.snapshot_interval,
        model=header.model,
        on_step_record=checker,
    )


# -- faithful -----------------------------------------------------------------------------------


def _steps(reader: TraceReader) -> Iterator[Step]:
    for entry in reader.entries():
        if isinstance(entry.record, Step):
            yield entry.record


class _FaithfulRunner:
    """Gives each scheduled request the tokens the trace says it sampled at this step.

    Entries are matched by position in scheduling order: with the recorded config that
    order is the recorded one (and when it is not, the checker reports the step)."""

    model_description = ""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.record: Step | None = None  # this step's record
        self.next: Step | None = None  # the next one, for speculative drafts
        self.refs: dict[str, int] = {}  # request id -> its latest ref

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        rec = self.record
        assert rec is not None
        ids = list(out.num_scheduled_tokens)
        num_entries = rec.num_decodes + len(rec.scheduled)
        counts: Sequence[int] = rec.sample_counts or (1,) * num_entries
        tokens = rec.sampled_tokens or ()
        sampled: list[list[int]] = []
        at = 0
        for i in range(len(ids)):
            count = counts[i] if i < len(counts) else 0
            sampled.append(list(tokens[at : at + count]))
            at += count
        drafts = self._drafts(ids, sampled) if self.k else {}
        return ModelRunnerOutput(ids, sampled, drafts)

    def _drafts(self, ids: list[str], sampled: list[list[int]]) -> dict[str, list[int]]:
        """Drafts that the next step verifies to what the trace says it accepted."""
        nxt = self.next
        if nxt is None:
            return {}
        accepted = {a.ref: a.accepted for a in nxt.spec_accepted}
        tokens_of = _tokens_by_ref(nxt)
        out: dict[str, list[int]] = {}
        for rid, got in zip(ids, sampled):
            if not got:
                continue
            ref = self.refs.get(rid)
            a = accepted.get(ref, 0) if ref is not None else 0
            toks = tokens_of.get(ref, []) if ref is not None else []
            out[rid] = _draft(toks, a, self.k)
        return out


def _tokens_by_ref(rec: Step) -> dict[int, list[int]]:
    """The explicit entries' sampled tokens by ref (speculative entries are explicit)."""
    tokens = rec.sampled_tokens or ()
    counts = rec.sample_counts
    n = rec.num_decodes
    at = n if counts is None else sum(counts[:n])
    out: dict[int, list[int]] = {}
    for i, e in enumerate(rec.scheduled):
        c = 1 if counts is None else counts[n + i]
        out[e.ref] = list(tokens[at : at + c])
        at += c
    return out


def _draft(tokens: list[int], accepted: int, k: int) -> list[int]:
    """k drafts: the first `accepted` right, the next one wrong (so verification stops)."""
    drafts = list(tokens[:accepted])
    if len(drafts) < k:
        drafts.append(tokens[accepted] + 1 if accepted < len(tokens) else 0)
    return (drafts + [0] * k)[:k]


def _run_faithful(
    reader: TraceReader, config: EngineConfig, out: str | Path | None, max_steps: int | None = None
) -> ResimResult:
    runner = _FaithfulRunner(config.num_speculative_tokens)
    engine = EngineCore(config, runner)
    checker = _Checker()
    recorder = _recorder(engine, reader, out, checker)
    hasher = BlockHasher(config.block_size)
    records = _steps(reader)
    nxt = next(records, None)
    recorded = 0
    try:
        while (
            nxt is not None
            and checker.divergence is None
            and (max_steps is None or recorded < max_steps)
        ):
            rec, nxt = nxt, next(records, None)
            recorded += 1
            _abort(engine, rec, runner.refs)
            for a in rec.arrivals:
                runner.refs[a.request_id] = a.ref
                engine.add_request(_request(a, hasher))
            runner.record, runner.next = rec, nxt
            checker.expect(rec)
            engine.step()
            engine.take_finished()  # nobody reads them: don't let them pile up
        # Requests still running when the trace ends are fine: a trace can stop mid-run
        # (a crash, a cut); had the original finished them, its last records would say so.
    finally:
        recorder.close()
    return ResimResult(
        config,
        {},
        reader.index().last_step + 1,
        checker.steps,
        checker.divergence,
        Path(out) if out else None,
        "faithful",
    )


def _abort(engine: EngineCore, rec: Step, refs: dict[str, int]) -> None:
    """Aborts happened between steps: the trace reports them with the next step."""
    for f in rec.finishes:
        if f.status == Status.FINISHED_ABORTED:
            rid = next((r for r, ref in refs.items() if ref == f.ref), None)
            if rid is not None:
                engine.abort(rid)


def _request(a: Arrival, hasher: Any) -> Request:
    s = a.sampling
    try:
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        )
    except ValueError as e:
        raise ResimError(f"request {a.request_id!r}: {e}") from None
    prompt = (
        list(a.prompt_token_ids) if a.prompt_token_ids is not None else [0] * a.num_prompt_tokens
    )
    return Request(
        a.request_id,
        prompt,
        params,
        arrival_time=a.arrival_time,
        priority=a.priority,
        eos_token_id=a.eos_token_id,
        block_hasher=hasher,
    )


# -- scripted -----------------------------------------------------------------------------------


@dataclass
class _Script:
    """Everything the trace says about one request."""

    arrival: Arrival  # how it arrived
    arrival_step: int  # when
    tokens: list[int] = field(default_factory=list)  # every token it sampled, in order
    accepted: list[int] = field(default_factory=list)  # drafts accepted, per verification
    status: int = 0  # how it finished (0: it had not when the trace ended)
    abort_step: int = -1  # the step whose record reports its abort
    hashes: dict[int, bytes] = field(default_factory=dict)  # block index -> recorded hash


def _collect(reader: TraceReader) -> tuple[list[_Script], int]:
    """Read the whole trace into per-request scripts (by ref); also the number of steps."""
    scripts: list[_Script] = []
    tables: dict[int, list[int]] = {}
    state = State.initial(reader.header)
    steps = 0
    for rec in _steps(reader):
        steps += 1
        for a in rec.arrivals:
            scripts.append(_Script(a, rec.step))
        view = apply_with_view(state, rec)
        for sample in view.samples:
            script = scripts[sample.ref]
            script.tokens += (
                list(sample.token_ids) if sample.token_ids is not None else [-1] * sample.count
            )  # redacted: filled in later
        for acc in rec.spec_accepted:
            scripts[acc.ref].accepted.append(acc.accepted)
        for f in rec.finishes:
            scripts[f.ref].status = f.status
            if f.status == Status.FINISHED_ABORTED:
                scripts[f.ref].abort_step = rec.step
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
    """SimRunner with recorded acceptances: each verification accepts what the trace's
    verification of that request (in the same order) accepted."""

    def __init__(self, k: int) -> None:
        super().__init__({}, num_speculative_tokens=k)
        self.accepted: dict[str, list[int]] = {}
        self.model_description = ""

    def _propose(self, rid: str) -> list[int]:
        queue = self.accepted.get(rid)
        right = queue.pop(0) if queue else 0
        pos = self.sampled[rid]
        return [self._token(rid, pos + j) + (0 if j < right else 1) for j in range(self.k)]


def _run_scripted(
    reader: TraceReader, config: EngineConfig, overrides: dict[str, Any], out: str | Path | None
) -> ResimResult:
    scripts, num_recorded = _collect(open_trace(reader.path))
    runner = _ScriptedRunner(config.num_speculative_tokens)
    engine = EngineCore(config, runner)
    checker = _Checker(_steps(open_trace(reader.path)))
    recorder = _recorder(engine, reader, out, checker)
    plain = BlockHasher(config.block_size)
    by_step: dict[int, list[int]] = {}
    aborts: dict[int, list[int]] = {}
    for ref, s in enumerate(scripts):
        by_step.setdefault(s.arrival_step, []).append(ref)
        if s.abort_step >= 0:
            aborts.setdefault(s.abort_step, []).append(ref)
    live: dict[str, int] = {}
    last_arrival = max(by_step, default=-1)
    limit = 10 * num_recorded + 10_000
    step = 0
    try:
        while step <= last_arrival or engine.has_unfinished():
            if step >= limit:
                raise ResimError(f"the re-simulation is still running at step {step}")
            for ref in aborts.get(step, ()):
                rid = scripts[ref].arrival.request_id
                if live.get(rid) == ref:
                    engine.abort(rid)
            for ref in by_step.get(step, ()):
                s = scripts[ref]
                a = s.arrival
                tokens = _fill_redacted(s) if reader.header.redacted else s.tokens
                runner.add_script(a.request_id, tokens)
                runner.accepted[a.request_id] = list(s.accepted)
                live[a.request_id] = ref
                hasher = (
                    _RecordedHasher(config.block_size, s, ref) if reader.header.redacted else plain
                )
                engine.add_request(_request(a, hasher))
            engine.step()
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
