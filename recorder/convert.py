"""StepReports to step records: request ids become refs, and what the reducer can derive
exactly is left out (after checking that it can).

The converter keeps a small mirror of the engine (live requests and the last queue
orders), updated in time proportional to what each step changed. A step of 256 decoding
requests costs two passes over its lists and is written as one count plus the sampled
tokens, not as 256 entries.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

from engine.kv.events import KVEventKind, KVEventLog
from engine.report import Kind as EngineKind
from engine.report import QueueStop as EngineQueueStop
from engine.report import StepReport
from engine.request import Request, RequestStatus
from engine.state import EngineState
from recorder.codec import STEP as STEP_BODY
from recorder.derive import running_after, waiting_after_fcfs, waiting_after_priority
from recorder.schema import (
    NO_KV_EVENTS,
    Admission,
    Arrival,
    Finish,
    Kernel,
    KVEvents,
    Preemption,
    QueueStop,
    RequestSnap,
    Sample,
    Sampling,
    Scheduled,
    Shortfall,
    Snapshot,
    SpecAccepted,
    SpecProposed,
    Step,
    Timing,
)

_DECODE = EngineKind.DECODE
_FREED = KVEventKind.FREED


@dataclass(slots=True)
class _Live:
    """What the converter keeps about one unfinished request."""

    ref: int  # its ref in the trace
    order: tuple[int, float, str]  # (priority, arrival_time, request_id): the PRIORITY order
    max_tokens: int  # from its sampling params
    arrival_step: int  # -1: it arrived before the recording started
    first_scheduled_step: int = -1  # step of its first admission (-1: not yet, or unknown)
    first_token_step: int = -1  # step of its first sampled token (-1: not yet, or unknown)


def ns(seconds: float) -> int:
    """Seconds as whole nanoseconds (never negative)."""
    return max(0, round(seconds * 1e9))


class _StepRefs:
    """Id-to-ref resolution for one report. An id finished and added again between two
    steps names two requests in the same report: finishes and the FREED event of the
    earlier one resolve to the older ref, everything else to the newer."""

    def __init__(self, live: dict[str, _Live]) -> None:
        self.live = live
        self.older: dict[str, list[int]] = {}  # reused ids: older refs, oldest first
        self.freed_older: dict[str, int] = {}  # reused ids whose older request held blocks

    def ref(self, rid: str) -> int:
        return self.live[rid].ref

    def finish_ref(self, rid: str) -> int:
        older = self.older.get(rid)
        return older.pop(0) if older else self.live[rid].ref

    def freed_ref(self, rid: str) -> int:
        ref = self.freed_older.pop(rid, None)
        return self.live[rid].ref if ref is None else ref


class StepConverter:
    """Turns each StepReport into a Step record; builds snapshots from engine states."""

    def __init__(self, policy: str, redact: bool) -> None:
        self.policy = policy
        self.redact = redact
        self.next_ref = 0
        self.live: dict[str, _Live] = {}
        self.awaiting_token: dict[int, str] = {}  # ref -> id: admitted, no token yet
        self.running: list[str] = []  # the last report's queues
        self.waiting: list[str] = []

    # -- attaching to a running engine ----------------------------------------------------------

    def adopt(self, requests: Sequence[Request], state: EngineState) -> Snapshot:
        """Take over an engine mid-run: refs for its requests, and a snapshot of it."""
        for req in requests:
            self.live[req.request_id] = _Live(
                self.next_ref, req.sort_key(), req.sampling_params.max_tokens, -1
            )
            if req.status != RequestStatus.WAITING and not req.output_token_ids:
                self.awaiting_token[self.next_ref] = req.request_id  # admitted, no token yet
            self.next_ref += 1
        self.running, self.waiting = list(state.running), list(state.waiting)
        return self.snapshot(state)

    def snapshot(self, state: EngineState) -> Snapshot:
        live = self.live
        requests = sorted(
            (
                RequestSnap(
                    info.ref,
                    r.request_id,
                    int(r.status),
                    r.num_prompt_tokens,
                    r.num_output_tokens,
                    r.num_computed_tokens,
                    r.block_ids,
                    r.num_preemptions,
                    r.priority,
                    info.order[1],
                    r.num_cached_tokens,
                    info.max_tokens,
                    info.arrival_step,
                    info.first_scheduled_step,
                    info.first_token_step,
                )
                for r in state.requests
                for info in (live[r.request_id],)
            ),
            key=attrgetter("ref"),
        )
        return Snapshot(
            step=state.step,
            next_ref=self.next_ref,
            requests=tuple(requests),
            running=tuple(live[r].ref for r in state.running),
            waiting=tuple(live[r].ref for r in state.waiting),
            free_queue=state.free_queue,
            cached_block_ids=tuple(b for b, _ in state.block_hashes),
            cached_hashes=tuple(h for _, h in state.block_hashes),
        )

    # -- one step ------------------------------------------------------------------------------

    def steady_body(self, rep: StepReport, *, time_ns: int = 0) -> bytes | None:
        """The encoded STEP body of a steady decode step (the running requests each decode
        one token and nothing else happens), built straight from the report: the same
        bytes as encoding `convert(rep)`, for a fraction of the work. None for any other
        step."""
        n = rep.num_leading_decodes
        if (
            n != len(rep.scheduled)
            or n != len(rep.sampled)
            or n != len(rep.sampled_flat)
            or rep.arrivals
            or rep.finishes
            or rep.admissions
            or rep.preemptions
            or rep.shortfalls
            or rep.running_stop
            or rep.waiting_stop
            or rep.num_spec_accepted
            or rep.num_spec_proposed
            or rep.timings
            or self.awaiting_token
            or n > len(self.running)
            or rep.running != self.running
            or rep.waiting != self.waiting
        ):
            return None
        kv = rep.kv_events
        body = STEP_BODY.encode_fields(
            {
                "step": rep.step,
                "time_ns": time_ns,
                "schedule_ns": ns(rep.schedule_s),
                "update_ns": ns(rep.update_s),
                "token_budget": rep.token_budget,
                "num_decodes": n,
                "sampled_tokens": None if self.redact else tuple(rep.sampled_flat),
                "kv_events": self._kv_events(kv, _StepRefs(self.live)) if kv else NO_KV_EVENTS,
                "free_blocks_after_schedule": rep.num_free_blocks_after_schedule,
                "free_blocks": rep.num_free_blocks,
            }
        )
        return body

    def convert(self, rep: StepReport, *, time_ns: int = 0) -> Step:
        refs = _StepRefs(self.live)
        arrivals = self._arrivals(rep, refs) if rep.arrivals else ()
        finishes = (
            tuple(
                Finish(refs.finish_ref(f.request_id), int(f.status), f.message)
                for f in rep.finishes
            )
            if rep.finishes
            else ()
        )
        aborted = {f.request_id for f in rep.finishes if f.status == RequestStatus.FINISHED_ABORTED}
        base = [r for r in self.running if r not in aborted] if aborted else self.running
        num_decodes, ids = self._decode_prefix(rep, base)
        counts, tokens, others = self._samples(rep, ids, refs)
        running, waiting = self._queues(rep, bool(refs.older))
        step = Step(
            step=rep.step,
            time_ns=time_ns,
            schedule_ns=ns(rep.schedule_s),
            update_ns=ns(rep.update_s),
            token_budget=rep.token_budget,
            arrivals=arrivals,
            num_decodes=num_decodes,
            finishes=finishes,
            sample_counts=counts,
            sampled_tokens=tokens,
            other_samples=others,
            kv_events=self._kv_events(rep.kv_events, refs) if rep.kv_events else NO_KV_EVENTS,
            free_blocks_after_schedule=rep.num_free_blocks_after_schedule,
            free_blocks=rep.num_free_blocks,
            running=running,
            waiting=waiting,
            timings=_timings(rep) if rep.timings else (),
            **self._decisions(rep, num_decodes, refs.ref),
        )
        self._advance(rep, step)
        return step

    @staticmethod
    def _decisions(rep: StepReport, num_decodes: int, ref: Callable[[str], int]) -> dict[str, Any]:
        """The step's less frequent fields, only where the report has something."""
        out: dict[str, Any] = {}
        if len(rep.scheduled) > num_decodes:
            out["scheduled"] = tuple(
                Scheduled(
                    ref(s.request_id),
                    s.num_tokens,
                    int(s.kind),
                    s.num_computed_before,
                    s.num_spec_tokens,
                )
                for s in rep.scheduled[num_decodes:]
            )
        if rep.admissions:
            out["admissions"] = tuple(
                Admission(ref(a.request_id), a.cached_tokens, a.resumed) for a in rep.admissions
            )
        if rep.preemptions:
            out["preemptions"] = tuple(
                Preemption(ref(p.victim), ref(p.for_request), p.tokens_lost, p.unscheduled_tokens)
                for p in rep.preemptions
            )
        if rep.shortfalls:
            out["shortfalls"] = tuple(
                Shortfall(ref(s.request_id), s.wanted, s.got, int(s.reason)) for s in rep.shortfalls
            )
        if rep.running_stop is not None:
            out["running_stop"] = _stop(rep.running_stop)
        if rep.waiting_stop is not None:
            out["waiting_stop"] = _stop(rep.waiting_stop)
        if rep.num_spec_accepted:
            out["spec_accepted"] = tuple(
                SpecAccepted(ref(r), n) for r, n in rep.num_spec_accepted.items()
            )
        if rep.num_spec_proposed:
            out["spec_proposed"] = tuple(
                SpecProposed(ref(r), n) for r, n in rep.num_spec_proposed.items()
            )
        return out

    def _arrivals(self, rep: StepReport, refs: _StepRefs) -> tuple[Arrival, ...]:
        first_new = self.next_ref
        out = []
        for a in rep.arrivals:
            rid = a.request_id
            older = self.live.get(rid)
            if older is not None:
                refs.older.setdefault(rid, []).append(older.ref)
                if older.ref < first_new:
                    refs.freed_older[rid] = older.ref
            ref = self.next_ref
            self.next_ref += 1
            self.live[rid] = _Live(
                ref, (a.priority, a.arrival_time, rid), a.sampling_params.max_tokens, rep.step
            )
            p = a.sampling_params
            out.append(
                Arrival(
                    ref,
                    rid,
                    len(a.prompt_token_ids),
                    a.priority,
                    a.arrival_time,
                    a.eos_token_id,
                    Sampling(
                        p.max_tokens,
                        p.temperature,
                        p.top_p,
                        p.top_k,
                        p.seed,
                        tuple(p.stop_token_ids),
                        p.ignore_eos,
                    ),
                    None if self.redact else tuple(a.prompt_token_ids),
                    tuple(a.prompt_block_hashes) if self.redact else None,
                )
            )
        return tuple(out)

    @staticmethod
    def _decode_prefix(rep: StepReport, base: list[str]) -> tuple[int, list[str]]:
        """How many leading entries are base[i] decoding one token; and every entry's id."""
        sched = rep.scheduled
        n = len(sched)
        if rep.num_leading_decodes == n and n <= len(base):
            return n, base[:n]  # the scheduler vouches: entry i is base[i] decoding one token
        # One pass for the common case: every entry a DECODE (one token, by definition).
        ids = [s.request_id for s in sched if s.kind is _DECODE]
        if len(ids) == n:
            if n <= len(base) and ids == base[:n]:
                return n, ids
        else:
            ids = [s.request_id for s in sched]
        k = 0
        for s, rid in zip(sched, base):
            if s.request_id != rid or s.kind != _DECODE or s.num_tokens != 1:
                break
            k += 1
        return k, ids

    def _samples(
        self, rep: StepReport, ids: list[str], refs: _StepRefs
    ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[Sample, ...]]:
        sampled = rep.sampled
        # Samples follow scheduling order, so when every entry sampled and the scheduler
        # vouched for the ids, the keys need no comparison.
        if len(sampled) == len(ids) and (
            rep.num_leading_decodes == len(ids) or list(sampled) == ids
        ):
            flat = rep.sampled_flat  # the engine flattened them while they were hot
            counts = None if len(flat) == len(ids) else tuple(map(len, sampled.values()))
            return counts, None if self.redact else tuple(flat), ()
        empty: list[int] = []
        per_entry = [sampled.get(rid, empty) for rid in ids]
        known = set(ids)
        others = tuple(
            Sample(refs.ref(rid), len(toks), None if self.redact else tuple(toks))
            for rid, toks in sampled.items()
            if rid not in known
        )
        return (
            tuple(map(len, per_entry)),
            None if self.redact else tuple(chain.from_iterable(per_entry)),
            others,
        )

    @staticmethod
    def _kv_events(log: KVEventLog, refs: _StepRefs) -> KVEvents:
        """The engine keeps the step's events as columns already: map ids to refs, drop
        the evicted hashes (the reducer knows what it drops), and take the rest whole."""
        live = refs.live
        if refs.freed_older:  # an id reused this step: its FREED may name the older request
            owners = [
                refs.freed_ref(rid) if kind is _FREED else live[rid].ref
                for kind, rid in zip(log.kinds, log.request_ids)
                if rid is not None
            ]
        else:
            owners = [live[rid].ref for rid in log.request_ids if rid is not None]
        return KVEvents(
            tuple(log.kinds),
            tuple(owners),
            tuple(log.sizes),
            tuple(log.block_ids),
            tuple(log.cached_hashes),
            tuple(log.hit_tokens),
        )

    def _queues(
        self, rep: StepReport, reused: bool
    ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """The end-of-step queues as refs, or None where the derivation gets them right."""
        if not (rep.arrivals or rep.admissions or rep.preemptions or rep.finishes):
            running_ok = rep.running == self.running  # nothing moved: cheap to check
            waiting_ok = rep.waiting == self.waiting
        elif reused:  # one id names two requests: write both queues out
            running_ok = waiting_ok = False
        else:
            admitted = [a.request_id for a in rep.admissions]
            preempted = [p.victim for p in rep.preemptions]
            finished = {f.request_id for f in rep.finishes}
            running_ok = (
                running_after(self.running, finished.union(preempted), admitted) == rep.running
            )
            waiting_ok = (
                self._derive_waiting(
                    [a.request_id for a in rep.arrivals], admitted, preempted, finished
                )
                == rep.waiting
            )
        live = self.live
        return (
            None if running_ok else tuple(live[r].ref for r in rep.running),
            None if waiting_ok else tuple(live[r].ref for r in rep.waiting),
        )

    def _derive_waiting(
        self, arrived: list[str], admitted: list[str], preempted: list[str], finished: set[str]
    ) -> list[str]:
        gone = finished.union(admitted)
        if self.policy == "priority":
            live = self.live
            return waiting_after_priority(
                self.waiting, arrived, preempted, gone, key=lambda r: live[r].order
            )
        return waiting_after_fcfs(self.waiting, arrived, preempted, gone)

    def _advance(self, rep: StepReport, step: Step) -> None:
        """Bring the mirror to the end of the step."""
        live = self.live
        for a in rep.admissions:
            info = live[a.request_id]
            if info.first_scheduled_step < 0:
                info.first_scheduled_step = rep.step
                self.awaiting_token[info.ref] = a.request_id
        if self.awaiting_token:  # only requests mid-prefill: a short loop
            sampled = rep.sampled
            for ref, rid in list(self.awaiting_token.items()):
                pending = live.get(rid)
                if rid in sampled and pending is not None and pending.ref == ref:
                    pending.first_token_step = rep.step
                    del self.awaiting_token[ref]
        for f, rec in zip(rep.finishes, step.finishes):
            self.awaiting_token.pop(rec.ref, None)
            done = live.get(f.request_id)
            if done is not None and done.ref == rec.ref:
                del live[f.request_id]
        self.running, self.waiting = rep.running, rep.waiting


def _stop(stop: EngineQueueStop | None) -> QueueStop | None:
    return None if stop is None else QueueStop(int(stop.head), int(stop.rest))


def _timings(rep: StepReport) -> tuple[Timing, ...]:
    return tuple(
        Timing(
            t.step,
            ns(t.prepare_s),
            ns(t.forward_s),
            None if t.attention_s is None else ns(t.attention_s),
            ns(t.sample_s),
            tuple(Kernel(k.name, k.calls, ns(k.total_s)) for k in t.kernels),
            ns(t.propose_s),
        )
        for t in rep.timings
    )


def scalar_config(values: dict[str, Any]) -> dict[str, Any]:
    """The config as plain scalars (a nested object as JSON text, anything else as its
    repr)."""
    return {
        k: v
        if v is None or isinstance(v, str | int | float | bool)
        else json.dumps(v, sort_keys=True)
        if isinstance(v, dict)
        else repr(v)
        for k, v in values.items()
    }
