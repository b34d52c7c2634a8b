"""The engine's step records, made compact for the trace: what the reducer can derive
exactly is left out (after checking that it can).

The engine reports every step explicitly (every scheduled entry, both queues); a trace
writes the leading entries that are the running requests decoding one token each as one
count, and leaves out the queues when the reducer derives them. To do that the compactor
keeps only the previous step's queues (refs), and under the priority policy the order key
of each waiting request: no mirror of the engine's requests. A step of 256 decoding
requests costs one pass over its entries and is written as one count plus the sampled
tokens, not as 256 entries.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.records import (
    Arrival,
    Snapshot,
    Status,
    Step,
    entry_refs,
    leading_decodes,
    trace_hashes,
)
from recorder.derive import running_after, waiting_after_fcfs, waiting_after_priority

_ABORTED = Status.FINISHED_ABORTED


class StepCompactor:
    """Turns each of the engine's step records into the trace's compact one."""

    def __init__(self, policy: str, redact: bool) -> None:
        self.policy = policy
        self.redact = redact
        self.running: tuple[int, ...] = ()  # the previous step's queues
        self.waiting: tuple[int, ...] = ()
        self.order: dict[int, tuple[int, float, str]] = {}  # priority: ref -> queue order

    def adopt(self, snap: Snapshot) -> None:
        """Take over an engine mid-run, from its snapshot."""
        self.running, self.waiting = snap.running, snap.waiting
        if self.policy == "priority":
            self.order = {r.ref: r.priority_order() for r in snap.requests}

    def compact(self, rep: Step, time_ns: int = 0) -> Step:
        """The step as a trace records it."""
        if rep.num_decodes:
            return self._compacted(rep, time_ns)
        steady = self._steady(rep, time_ns)
        if steady is not None:
            return steady
        return self.general(rep, time_ns)

    def general(self, rep: Step, time_ns: int = 0) -> Step:
        """`compact` for any step, without the steady-decode shortcut. A report whose
        leading decodes are implicit already (num_decodes) keeps them so."""
        arrivals = tuple(map(self._arrival, rep.arrivals)) if rep.arrivals else ()
        if rep.num_decodes:
            if rep.running is None or rep.waiting is None or rep.num_decodes > len(self.running):
                raise ValueError(
                    f"step {rep.step}: a report with num_decodes={rep.num_decodes} and other "
                    "changes must give both queues, and at most as many decodes as the "
                    f"{len(self.running)} running requests"
                )
            num_decodes, scheduled = rep.num_decodes, rep.scheduled
        else:
            num_decodes = self._decode_prefix(rep)
            scheduled = rep.scheduled[num_decodes:] if num_decodes else rep.scheduled
        running, waiting = self._queues(rep)
        step = replace(
            rep,
            time_ns=time_ns,
            arrivals=arrivals,
            num_decodes=num_decodes,
            scheduled=scheduled,
            sampled_tokens=None if self.redact else rep.sampled_tokens,
            running=running,
            waiting=waiting,
        )
        self._advance(rep)
        return step

    def _steady(self, rep: Step, time_ns: int) -> Step | None:
        """A steady decode step (the running requests each decode and sample one token and
        nothing else happens) made compact straight away: a count and the sampled tokens,
        and nothing to remember for the next step. None for any other step."""
        if not self.is_steady(rep):
            return None
        return self._decodes_only(rep, len(rep.scheduled), time_ns)

    def is_steady(self, rep: Step) -> bool:
        """Whether `rep` (reported in full, num_decodes 0) is a steady decode step: its
        record is then the fields of STEADY_FIELDS, the leading decodes being all of its
        `len(rep.scheduled)` entries, and the compactor has nothing to remember of it."""
        n = len(rep.scheduled)
        # With nothing preempted, admitted, cut short or stopped, every running request was
        # scheduled, in running order: the entries' refs need no comparison, their kinds do.
        # Every field that a steady record leaves out must hold its default.
        return not (
            rep.sample_counts is not None
            or rep.arrivals
            or rep.finishes
            or rep.admissions
            or rep.preemptions
            or rep.shortfalls
            or rep.running_stop
            or rep.waiting_stop
            or rep.other_samples
            or rep.spec_accepted
            or rep.spec_proposed
            or rep.timings
            or rep.free_slots
            or rep.cached_slots
            or rep.evicted_slots
            or rep.slot_allocs
            or rep.slot_writes
            or rep.slots_freed_first
            or rep.slots_freed
            or n != len(self.running)
            or rep.running != self.running
            or rep.waiting != self.waiting
            or leading_decodes(rep.scheduled) != n  # Entries: O(1)
        )

    def _compacted(self, rep: Step, time_ns: int) -> Step:
        """A step whose reporter made its leading decodes implicit itself (recorder.vllm
        reads them off vLLM's batch with no per-request record). A steady one (its leading
        decodes are the whole running queue, nothing else moved, no queues reported) is
        taken as it is; any other goes through `general`."""
        if rep.running is not None or rep.waiting is not None:
            return self.general(rep, time_ns)
        if (
            rep.num_decodes != len(self.running)
            or rep.scheduled
            or rep.arrivals
            or rep.finishes
            or rep.admissions
            or rep.preemptions
            or rep.shortfalls
        ):
            raise ValueError(
                f"step {rep.step}: a step reported with num_decodes={rep.num_decodes} must be "
                f"a steady decode of all {len(self.running)} running requests"
            )
        return self._decodes_only(rep, rep.num_decodes, time_ns)

    def _decodes_only(self, rep: Step, n: int, time_ns: int) -> Step:
        """The record of a steady decode step: `n` leading decodes, their samples, the KV
        events and free counts, nothing else (the queues did not move)."""
        return Step(
            step=rep.step,
            time_ns=time_ns,
            schedule_ns=rep.schedule_ns,
            update_ns=rep.update_ns,
            token_budget=rep.token_budget,
            num_decodes=n,
            sample_counts=rep.sample_counts,
            sampled_tokens=None if self.redact else rep.sampled_tokens,
            kv_events=rep.kv_events,
            free_blocks_after_schedule=rep.free_blocks_after_schedule,
            free_blocks=rep.free_blocks,
            work_ns=rep.work_ns,
        )

    def _arrival(self, a: Arrival) -> Arrival:
        if self.policy == "priority":
            self.order[a.ref] = (a.priority, a.arrival_time, a.request_id)
        if self.redact:
            hashes = a.prompt_block_hashes
            return replace(
                a,
                prompt_token_ids=None,
                prompt_block_hashes=None if hashes is None else trace_hashes(hashes),
            )
        if a.prompt_block_hashes is None:
            return a  # nothing to take out (replace() costs more than the rest of a step)
        return replace(a, prompt_block_hashes=None)

    def _decode_prefix(self, rep: Step) -> int:
        """How many leading entries are the running requests (as schedule() found them)
        decoding one token each."""
        sched = rep.scheduled
        n = len(sched)
        if not n:
            return 0
        base = self.running
        if rep.finishes and any(f.status == _ABORTED for f in rep.finishes):
            aborted = {f.ref for f in rep.finishes if f.status == _ABORTED}
            base = tuple(r for r in base if r not in aborted)
        # The engine's entries (Entries) answer both without a record built per entry.
        m = leading_decodes(sched)
        refs = entry_refs(sched)
        if m <= len(base) and refs[:m] == tuple(base[:m]):  # every decode, in running order
            return m
        k = 0
        for ref, expected in zip(refs[:m], base):
            if ref != expected:
                break
            k += 1
        return k

    def _queues(self, rep: Step) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        """The end-of-step queues, or None where the derivation gets them right."""
        running, waiting = rep.running or (), rep.waiting or ()
        if not (rep.arrivals or rep.admissions or rep.preemptions or rep.finishes):
            running_ok = running == self.running  # nothing moved: cheap to check
            waiting_ok = waiting == self.waiting
        else:
            admitted = [a.ref for a in rep.admissions]
            preempted = [p.victim for p in rep.preemptions]
            finished = {f.ref for f in rep.finishes}
            running_ok = running_after(self.running, finished.union(preempted), admitted) == list(
                running
            )
            waiting_ok = self._derive_waiting(
                [a.ref for a in rep.arrivals], admitted, preempted, finished
            ) == list(waiting)
        return (None if running_ok else running, None if waiting_ok else waiting)

    def _derive_waiting(
        self, arrived: list[int], admitted: list[int], preempted: list[int], finished: set[int]
    ) -> list[int]:
        gone = finished.union(admitted)
        if self.policy == "priority":
            return waiting_after_priority(
                self.waiting, arrived, preempted, gone, key=self.order.__getitem__
            )
        return waiting_after_fcfs(self.waiting, arrived, preempted, gone)

    def _advance(self, rep: Step) -> None:
        """Keep the step's queues for the next one."""
        self.running, self.waiting = rep.running or (), rep.waiting or ()
        if self.order and rep.finishes:
            for f in rep.finishes:
                self.order.pop(f.ref, None)


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
