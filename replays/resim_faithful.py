"""The faithful re-simulation runner: the recorded config and token ids. It streams the
trace once and hands each step's recorded samples to the scheduled requests in
scheduling order, so it keeps pace with the simulated engine itself."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from recorder.reader import TraceReader
from recorder.schema import Status, Step
from replays.resim_base import (
    Checker,
    ResimResult,
    is_mid_step_abort,
    recorded_proposals,
    recorder_for,
    request_of,
)


class _FaithfulRunner:
    """Gives each scheduled request the tokens the trace says it sampled at this step.

    Entries are matched by position in scheduling order: with the recorded config that
    order is the recorded one (and when it is not, the checker reports the step)."""

    model_description = ""

    def __init__(self, config: EngineConfig) -> None:
        self.k = config.num_speculative_tokens
        self.recorded_proposals = recorded_proposals(config)
        self.record: Step | None = None  # this step's record
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
        if rec.spec_accepted:
            self._pad_stopped(ids, sampled, rec)
        drafts = self._drafts(ids, sampled) if self.k else {}
        return ModelRunnerOutput(ids, sampled, drafts)

    def _pad_stopped(self, ids: list[str], sampled: list[list[int]], rec: Step) -> None:
        """A request that stopped inside its accepted drafts recorded only the tokens up
        to the stop, but the scheduler counts acceptances before trimming: hand it
        `accepted + 1` tokens again (the filler after the stop is trimmed the same way)."""
        accepted = {a.ref: a.accepted for a in rec.spec_accepted}
        for rid, got in zip(ids, sampled):
            a = accepted.get(self.refs.get(rid, -1))
            if a is not None and got and len(got) < a + 1:
                got += [got[-1]] * (a + 1 - len(got))

    def _drafts(self, ids: list[str], sampled: list[list[int]]) -> dict[str, list[int]]:
        """As many drafts as the trace says were proposed. Their values do not matter:
        the next verification samples the recorded tokens, and the scheduler counts
        acceptances from how many there are."""
        rec = self.record
        assert rec is not None
        counts = {p.ref: p.count for p in rec.spec_proposed}
        out: dict[str, list[int]] = {}
        for rid, got in zip(ids, sampled):
            if got:
                n = counts.get(self.refs.get(rid, -1), 0) if self.recorded_proposals else self.k
                out[rid] = [0] * n
        return out


def run_faithful(
    reader: TraceReader, config: EngineConfig, out: str | Path | None, max_steps: int | None = None
) -> ResimResult:
    runner = _FaithfulRunner(config)
    engine = EngineCore(config, runner)
    checker = Checker()
    recorder = recorder_for(engine, reader.header, out, checker)
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
            for a in rec.arrivals:
                runner.refs[a.request_id] = a.ref
                engine.add_request(request_of(a, hasher))
            # After the arrivals: a request can arrive and be aborted before one step.
            _abort(engine, rec, runner.refs, mid_step=False)
            runner.record = rec
            checker.expect(rec)
            engine.step(partial(_abort, engine, rec, runner.refs, True))
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


def _abort(engine: EngineCore, rec: Step, refs: dict[str, int], mid_step: bool) -> None:
    """The step's aborts: those before its schedule() (reported with the step), or with
    `mid_step` those between schedule() and update."""
    for f in rec.finishes:
        if f.status == Status.FINISHED_ABORTED and is_mid_step_abort(f.message) == mid_step:
            rid = next((r for r, ref in refs.items() if ref == f.ref), None)
            if rid is not None:
                engine.abort(rid, f.message)
