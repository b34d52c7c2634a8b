"""The faithful re-simulation runner: the recorded config and token ids. It streams the
trace once and hands each step's recorded samples to the scheduled requests in
scheduling order, so it keeps pace with the simulated engine itself."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.driver import CoreEngine, RequestScript, StepDriver
from engine.kv.hashing import BlockHasher
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from recorder.reader import TraceReader
from recorder.schema import Status, Step
from replays.resim_base import (
    Checker,
    ResimResult,
    check_sampled_ids,
    is_mid_step_abort,
    recorded_proposals,
    recorder_for,
)


class _Recorded:
    """The trace's step records, read once as the run goes, in the two roles the faithful
    re-simulation has for them: the driver's inputs (step i's arrivals and aborts are
    record i's, handed to the checker as the decisions to reproduce) and the runner (each
    scheduled request gets the tokens record i says it sampled).

    Entries are matched by position in scheduling order: with the recorded config that
    order is the recorded one (and when it is not, the checker reports the step)."""

    model_description = ""

    def __init__(
        self, config: EngineConfig, records: Iterator[Step], checker: Checker, max_steps: int
    ) -> None:
        self.k = config.num_speculative_tokens
        self.recorded_proposals = recorded_proposals(config)
        self.records = records
        self.next = next(records, None)
        self.checker = checker
        self.max_steps = max_steps
        self.record: Step | None = None  # this step's record
        self.refs: dict[str, int] = {}  # request id -> its latest ref
        self.by_ref: dict[int, RequestScript] = {}

    def arrivals(self, step: int) -> list[RequestScript]:
        rec = self.next
        assert rec is not None  # over() said there is one
        self.next = next(self.records, None)
        check_sampled_ids(rec, redacted=False)  # a redacted trace is re-simulated scripted
        self.record = rec
        self.checker.expect(rec)
        scripts = []
        for a in rec.arrivals:
            self.refs[a.request_id] = a.ref
            self.by_ref[a.ref] = s = RequestScript(a, rec.step)
            scripts.append(s)
        return scripts

    def aborts(self, step: int, mid_step: bool) -> list[RequestScript]:
        assert self.record is not None
        due = []
        for f in self.record.finishes:
            s = self.by_ref.get(f.ref)
            if (
                s
                and f.status == Status.FINISHED_ABORTED
                and is_mid_step_abort(f.message) == mid_step
            ):
                s.abort_message = f.message
                due.append(s)
        return due

    def over(self, step: int, requests: bool, batches: bool) -> bool:
        # Requests still running when the trace ends are fine: a trace can stop mid-run
        # (a crash, a cut); had the original finished them, its last records would say so.
        return self.next is None or self.checker.divergence is not None or step >= self.max_steps

    def skip_idle(self) -> bool:
        return False

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
    checker = Checker()
    limit = sys.maxsize if max_steps is None else max_steps
    recorded = _Recorded(config, reader.steps(), checker, limit)
    engine = EngineCore(config, recorded)
    recorder = recorder_for(engine, reader.header, out, checker)
    hasher = BlockHasher(config.block_size)
    try:
        for _ in StepDriver(CoreEngine(engine, lambda s: hasher), recorded, sys.maxsize).run():
            pass
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
