"""Per-request scripts read from a trace: what each request did (its tokens, acceptances,
aborts, and for redacted traces its block hashes), and the runner that replays them.

Every re-simulation with other settings reads the trace into scripts first and drives
them with engine.driver: `resim`'s scripted runner (at the recorded steps), `whatif` (at
the recorded times) and `resim --engine vllm`."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.driver import CoreEngine, RequestScript, ScriptedInputs
from engine.kv.hashing import ROOT_HASH, BlockHasher
from engine.request import Request
from engine.sim.runner import SimRunner
from recorder.reader import TraceReader
from recorder.schema import Footer, KVKind, Status, Step
from replays.reducer import StepView, apply_with_view
from replays.resim_base import check_sampled_ids, is_mid_step_abort, recorded_proposals
from replays.run_end import run_is_over
from replays.state import State


class ScriptCollector:
    """Builds the scripts from step records and the reducer's views of them, in order
    (a caller that already reduces the trace for something else feeds it as it goes)."""

    def __init__(self, redacted: bool) -> None:
        self.redacted = redacted
        self.scripts: list[RequestScript] = []  # by ref
        self.steps = 0  # step records seen
        self._tables: dict[int, list[int]] = {}  # ref -> its block table

    def add(self, rec: Step, view: StepView) -> None:
        scripts = self.scripts
        self.steps += 1
        check_sampled_ids(rec, self.redacted)
        for a in rec.arrivals:
            scripts.append(RequestScript(a, rec.step))
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
                scripts[f.ref].abort_mid_step = is_mid_step_abort(f.message)
                scripts[f.ref].abort_order = i
        for e in view.kv_events:
            if e.ref is None:
                continue
            table = self._tables.setdefault(e.ref, [])
            if e.kind in (KVKind.ALLOCATED, KVKind.PREFIX_HIT):
                table += e.block_ids
            elif e.kind == KVKind.FREED:
                table.clear()
            elif e.kind == KVKind.CACHED:
                for b, h in zip(e.block_ids, e.hashes):
                    scripts[e.ref].hashes[table.index(b)] = h


def collect_scripts(reader: TraceReader) -> tuple[list[RequestScript], int]:
    """Read the whole trace into per-request scripts (by ref); also the number of steps."""
    collector = ScriptCollector(reader.header.redacted)
    state = State.initial(reader.header)
    for rec in reader.steps():
        collector.add(rec, apply_with_view(state, rec))
    return collector.scripts, collector.steps


def fill_redacted(script: RequestScript) -> list[int]:
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


class RecordedHasher:
    """Block hashes for a redacted request: the recorded ones where the trace has them
    (prompt blocks, and every block the request got cached), stand-ins elsewhere."""

    def __init__(self, block_size: int, script: RequestScript, ref: int) -> None:
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


class ScriptedRunner(SimRunner):
    """SimRunner with recorded acceptances: a verification that starts at a request's
    output position accepts what the trace's verification there accepted."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__({}, num_speculative_tokens=config.num_speculative_tokens)
        self.accepted: dict[str, dict[int, int]] = {}  # request -> output position -> accepted
        self.proposed: dict[str, dict[int, int]] = {}  # request -> output position -> proposed
        self.recorded_proposals = recorded_proposals(config)
        self.model_description = ""

    def add(self, script: RequestScript, tokens: list[int]) -> None:
        """Script a request: `tokens` to sample, and the trace's drafts for it."""
        rid = script.arrival.request_id
        self.add_script(rid, tokens)
        self.accepted[rid] = script.accepted
        self.proposed[rid] = script.proposed

    def _propose(self, rid: str) -> list[int]:
        pos = self.sampled[rid]
        right = self.accepted.get(rid, {}).get(pos, 0)
        if self.recorded_proposals:
            n = self.proposed.get(rid, {}).get(pos, 0)
            return [self._token(rid, pos + j) + (0 if j < right else 1) for j in range(n)]
        return [self._token(rid, pos + j) + (0 if j < right else 1) for j in range(self.k)]


def scripted_engine(engine: EngineCore, runner: ScriptedRunner, redacted: bool) -> CoreEngine:
    """`engine` behind the step driver with `runner` scripted: each request gets its
    recorded tokens and, in a redacted trace, stand-in tokens and its recorded hashes."""
    plain = BlockHasher(engine.config.block_size)

    def add(s: RequestScript) -> None:
        runner.add(s, fill_redacted(s) if redacted else s.tokens)

    def hasher(s: RequestScript) -> BlockHasher | RecordedHasher:
        return RecordedHasher(plain.block_size, s, s.arrival.ref) if redacted else plain

    return CoreEngine(engine, hasher, add)


class RecordedInputs(ScriptedInputs):
    """Scripts at their recorded steps, in a run that ends where the recording ended its
    own (replays.run_end): batches in flight drained only as far as it did, and a
    recording that ended early (`footer` None: killed; or stopped) followed only that far,
    unless `overrides` make it a what-if. `num_recorded` None: a workload, no recording;
    `run_to`: a step the run reaches even with nothing left to do (vLLM's driver covers
    every recorded step)."""

    def __init__(
        self,
        scripts: list[RequestScript],
        num_recorded: int | None,
        footer: Footer | None = None,
        overrides: dict[str, Any] | None = None,
        run_to: int = -1,
    ) -> None:
        super().__init__(scripts)
        self.last_input_step = max(scripts[-1].arrival_step if scripts else -1, run_to)
        self.num_recorded = num_recorded
        self.ended_early = (
            num_recorded is not None and not overrides and (footer is None or bool(footer.stopped))
        )

    def over(self, step: int, requests: bool, batches: bool) -> bool:
        return run_is_over(
            step, self.last_input_step, self.num_recorded, requests, batches, self.ended_early
        )
