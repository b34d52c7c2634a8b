"""The faithful re-simulation runner: the recorded config and token ids. It streams the
trace once and hands each step's recorded samples to the scheduled requests in
scheduling order, so it keeps pace with the simulated engine itself."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from recorder.reader import TraceReader
from recorder.schema import Status, Step
from replays.resim_base import Checker, ResimResult, recorder_for, request_of


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


def run_faithful(
    reader: TraceReader, config: EngineConfig, out: str | Path | None, max_steps: int | None = None
) -> ResimResult:
    runner = _FaithfulRunner(config.num_speculative_tokens)
    engine = EngineCore(config, runner)
    checker = Checker()
    recorder = recorder_for(engine, reader, out, checker)
    hasher = BlockHasher(config.block_size)
    records = reader.steps()
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
                engine.add_request(request_of(a, hasher))
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
