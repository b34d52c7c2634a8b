"""The recording state of one SGLang scheduler: what each step decided, built into
schedtop's step records and handed to the Recorder (converter and background writer).

A trace step is one `get_next_batch_to_run` that decided something, plus the results
processed before the next one (with SGLang's overlap scheduler, the previous batch's:
samples arrive one step late, as in vLLM's async scheduler). SGLang runs a prefill (extend)
batch whenever it can form one, else decodes the running batch; a request it retracts
for room is a preemption with cause RETRACTED, and goes back to the waiting queue.

SGLang's KV pool is token-granular and its prefix cache a radix tree, so the trace's
block map stays empty (no KV events; header kv_pool "tokens"): the pool's occupancy is
each step's free_slots and cached_slots (docs/trace-format.md, 1.5), and with page_size 1
the slot map says which slot is whose (1.9: slots given, freed, written into rows by the
radix cache; docs/trace-format.md section 16). The tap keeps the
state the records build (schedtop's own reducer, applied as it writes them), which gives
the snapshots and checks every record before it is written; the slot map alone is checked
only under SCHEDTOP_STRICT, and a snapshot's token pool is read from SGLang's.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
from collections.abc import Callable
from itertools import chain, repeat
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.records import (
    Admission,
    Arrival,
    Finish,
    Kind,
    Preemption,
    QueueStop,
    Reason,
    Sample,
    SamplingParams,
    Scheduled,
    SlotWrite,
    Snapshot,
    Status,
    Step,
)
from engine.rules import queue_stop
from recorder.recorder import Recorder, RecorderOptions, TapEngine
from recorder.writer import TraceWriter
from replays.reducer import apply
from replays.slots import to_runs
from replays.state import State

log = logging.getLogger("schedtop.recorder.sglang")

# SGLang's finish reasons by class name (sglang/srt/managers/schedule_batch.py)
_FINISHED = {
    "FINISH_MATCHED_TOKEN": Status.FINISHED_STOPPED,
    "FINISH_MATCHED_STR": Status.FINISHED_STOPPED,
    "FINISHED_MATCHED_REGEX": Status.FINISHED_STOPPED,
    "FINISH_LENGTH": Status.FINISHED_LENGTH_CAPPED,
    "FINISH_ABORT": Status.FINISHED_ABORTED,
}
# The message of an abort's finish: the step before which SGLang received the abort (a
# running request finishes at its next result, maybe steps later), so that `resim
# --engine sglang` can send it at the same point.
ABORT_RECEIVED = "abort received before step "
# PrefillAdder.add_one_req's results (AddReqResult) for the request it left waiting
_WAIT_REASON = {"NO_TOKEN": Reason.KV_BLOCKS, "OTHER": Reason.TOKEN_BUDGET}
_RID = operator.attrgetter("rid")
_OUTPUTS = operator.attrgetter("num_output_tokens")
# Freed slots up to this many are copied out as a Python list (on_free)
_FEW_SLOTS = 512


@dataclasses.dataclass
class _Step:
    """What the step being built has seen so far."""

    arrivals: list[Arrival] = dataclasses.field(default_factory=list)
    # a decode batch's requests, in batch order, and their tokens computed before it: no
    # Scheduled built for them when they are the running queue's head, in order (the
    # record's implicit decodes, as the compactor would make them)
    decodes: list[int] = dataclasses.field(default_factory=list)
    decodes_before: list[int] = dataclasses.field(default_factory=list)
    scheduled: list[Scheduled] = dataclasses.field(default_factory=list)  # any other entry
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    preemptions: list[Preemption] = dataclasses.field(default_factory=list)
    finishes: list[Finish] = dataclasses.field(default_factory=list)
    samples: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    waiting: list[int] = dataclasses.field(default_factory=list)
    waiting_stop: QueueStop | None = None
    schedule_ns: int = 0
    update_ns: int = 0
    decided: bool = False  # a get_next_batch_to_run has run for it
    start_ns: int = 0  # monotonic, when its get_next_batch_to_run began
    evicted: int = 0  # slots the radix cache evicted since the step began (format 1.8)
    # the slot map (format 1.9): slots given to the scheduled entries, written into rows,
    # freed in the schedule (before the allocations) and after it, as runs
    # (the freed slots as SGLang's tensors, sorted into runs when the step is written:
    # which slot is free is all the reducer needs, and a request's decode slots, which
    # interleave with the others', are a few runs once sorted with theirs)
    allocs: list[int] = dataclasses.field(default_factory=list)
    writes: list[SlotWrite] = dataclasses.field(default_factory=list)
    freed_first: list[Any] = dataclasses.field(default_factory=list)
    freed: list[Any] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.arrivals
            or self.decodes
            or self.scheduled
            or self.preemptions
            or self.finishes
            or self.samples
        )


def sglang_config(sched: Any) -> tuple[EngineConfig, dict[str, Any]]:
    """SGLang's scheduler config under schedtop's names where they mean the same, and
    SGLang's own (prefixed `sglang_`) where they do not."""
    args = sched.server_args
    slots = int(sched.max_total_num_tokens)
    chunk = sched.chunked_prefill_size
    budget = int(sched.max_prefill_tokens)
    seqs = int(sched.max_running_requests)
    config = EngineConfig(
        block_size=1,  # a token pool: one slot a token
        num_blocks=slots + 1,  # slot 0 is SGLang's padding slot, as block 0 is ours
        max_num_batched_tokens=max(budget, seqs),
        max_num_seqs=seqs,
        max_model_len=int(sched.max_req_len),
        long_prefill_token_threshold=0,
        policy="fcfs",  # the reducer's; the queue orders are recorded explicitly
        enable_prefix_caching=not bool(args.disable_radix_cache),
        enable_chunked_prefill=chunk is not None and chunk > 0,
    )
    extra = {
        "sglang_schedule_policy": str(sched.schedule_policy),
        "sglang_chunked_prefill_size": chunk if chunk is None else int(chunk),
        "sglang_max_prefill_tokens": budget,
        "sglang_page_size": int(args.page_size or 1),
        "sglang_schedule_conservativeness": float(args.schedule_conservativeness),
        "sglang_enable_mixed_chunk": bool(args.enable_mixed_chunk),
        "sglang_overlap_schedule": bool(getattr(sched, "enable_overlap", False)),
        # SGLang's test knob that retracts every N forward passes: it changes decisions,
        # so a re-simulation must set it too (0: off)
        "sglang_test_retract_interval": _test_retract_interval(),
    }
    return config, extra


def _test_retract_interval() -> int:
    from sglang.srt.managers import scheduler

    return int(scheduler.TEST_RETRACT_INTERVAL) if scheduler.TEST_RETRACT else 0


def _sampling(req: Any) -> SamplingParams:
    sp = req.sampling_params
    top_k = int(sp.top_k)
    return SamplingParams(
        max_tokens=int(sp.max_new_tokens if sp.max_new_tokens is not None else 0),
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=top_k if 0 < top_k < (1 << 20) else 0,  # SGLang says "off" with -1 or 1 << 30
        stop_token_ids=tuple(sorted(int(t) for t in (sp.stop_token_ids or ()))),
        ignore_eos=bool(sp.ignore_eos),
    )


def tensor_runs(t: Any) -> list[int]:
    """A 1-D tensor of slot ids as runs (start, length, ...): the short ones in Python, the
    long ones (a prompt's) in a few tensor operations, whatever their length."""
    n = int(t.numel())
    if n <= 64:
        return list(to_runs(t.tolist()))
    import torch

    t = t.reshape(-1)
    breaks = torch.nonzero(t[1:] - t[:-1] != 1).reshape(-1) + 1
    starts = torch.cat((breaks.new_zeros(1), breaks))
    ends = torch.cat((breaks, breaks.new_full((1,), n)))
    out: list[int] = []
    for start, length in zip(t[starts].tolist(), (ends - starts).tolist()):
        out += (start, length)
    return out


def _sorted_runs(parts: list[Any]) -> tuple[int, ...]:
    """Freed slots (lists, or tensors where there were many), sorted, as runs."""
    if not parts:
        return ()
    if all(type(p) is list for p in parts):
        slots = parts[0] if len(parts) == 1 else list(chain.from_iterable(parts))
        slots.sort()  # the tap's own copies
        return to_runs(slots)
    import torch

    tensors = [torch.tensor(p, dtype=torch.int64) if type(p) is list else p for p in parts]
    t = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return tuple(tensor_runs(torch.sort(t).values))


class Tap(TapEngine):
    """All the recording state, kept apart from SGLang's scheduler attributes."""

    cost_write_ns = 0  # thread time writing the cost file that the hook has not left out

    def __init__(self, sched: Any, config: EngineConfig, description: tuple[str, str]) -> None:
        self.sched = sched
        self.config = config
        self.description = description  # (engine, model) for the trace's header
        self.refs: dict[str, int] = {}  # SGLang request id -> ref, while live
        self.reqs: dict[int, Any] = {}  # ref -> SGLang's Req, while live (snapshots' rows)
        self.seen_outputs: dict[int, int] = {}  # ref -> output tokens recorded
        self.running: list[int] = []  # admitted, not finished or retracted, in order
        self.last_running: tuple[int, ...] = ()  # the last record's queues
        self.last_waiting: tuple[int, ...] = ()
        self.status: dict[int, int] = {}  # ref -> Status (WAITING, RUNNING, PREEMPTED)
        self.computed: dict[int, int] = {}  # ref -> tokens computed, as the trace has it
        self.attempts: dict[str, str] = {}  # rid -> PrefillAdder's last result this step
        self.abort_received: dict[int, int] = {}  # ref -> the step before which it came
        self.pending_arrivals: list[Arrival] = []  # queued between two steps
        self.pending_finishes: list[Finish] = []  # aborts between two steps
        self.step = _Step()
        self.next_step = 0
        self.next_ref = 0
        self.stopped: str | None = None
        self.recorder: Recorder | None = None
        self.state: State | None = None
        self.check = os.environ.get("SCHEDTOP_STRICT") == "1"
        # the slot map (format 1.9): SGLang's token pool slot by slot, where one slot is
        # one token (page_size 1); in_schedule: inside get_next_batch_to_run
        # (SCHEDTOP_SLOT_MAP=0 leaves it out: it about doubles the recorder's CPU time)
        self.slot_map = (
            int(sched.server_args.page_size or 1) == 1
            and os.environ.get("SCHEDTOP_SLOT_MAP", "1") != "0"
        )
        self.in_schedule = False
        # What recording costs, for the overhead bench (SCHEDTOP_COST_FILE): the scheduler
        # thread's CPU time in the hooks (hooks._cpu counts it), written out whenever the
        # scheduler goes idle with the flush timer's CPU time and the whole process's.
        self.cpu_ns = 0
        cost = os.environ.get("SCHEDTOP_COST_FILE")
        self.cost_file = Path(cost) if cost else None
        self.cost_seq = 0

    @classmethod
    def start(cls, sched: Any, path: Path) -> Tap:
        from importlib.metadata import version

        config, extra = sglang_config(sched)
        model = str(getattr(sched.server_args, "model_path", ""))
        tap = cls(sched, config, (f"SGLang {version('sglang')} (Scheduler)", model))
        flush_s = float(os.environ.get("SCHEDTOP_FLUSH_INTERVAL_S", "1.0"))
        writer = TraceWriter(path, live=False, flush_interval_s=flush_s)
        options = RecorderOptions(
            snapshot_interval=int(os.environ.get("SCHEDTOP_SNAPSHOT_INTERVAL", "4096")),
            snapshot_work=0,
            kv_pool="tokens",
            slot_map=tap.slot_map,
            own_config=extra,
            # SGLang's engine SIGKILLs its scheduler process at shutdown, and a hung one is
            # killed too: the timer keeps the file at most this far behind the steps, the
            # steps' batches included. Steps are encoded in batches (a quarter of that):
            # right after a forward pass the recorder's code is out of the CPU's caches, and
            # a batch pays for that once, not once a step.
            flush_interval_s=flush_s * 3 / 4,
            batch_s=flush_s / 4,
        )
        tap.recorder = Recorder(tap, writer, options)
        state = State.initial(tap.recorder.header)
        # The slot map is applied to the tap's state only to check it (SCHEDTOP_STRICT):
        # it was most of the reducer's time a step, and a snapshot reads SGLang's own pool
        # instead (live_slots), which holds the same slots at a step's end.
        if not tap.check:
            state.slots = None
        tap.state = state
        log.info("schedtop: recording SGLang's scheduler into %s", path)
        return tap

    # -- failures --------------------------------------------------------------------------

    def guard(self, fn: Callable[..., None], *args: Any) -> None:
        """A hook's work: an exception stops the recording (with one warning), never SGLang."""
        try:
            fn(*args)
        except Exception as e:
            if self.check:
                raise
            log.exception("schedtop: recording SGLang failed")
            self.stop(f"{type(e).__name__}: {e}")

    def stop(self, why: str) -> None:
        if self.stopped is None:
            self.stopped = why
            log.warning("schedtop recording stopped: %s", why)
            self.close()

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    # -- the step --------------------------------------------------------------------------

    def before_schedule(self) -> None:
        step = self.step
        if step.decided and step:
            self.end_step()
        elif step.decided:  # an idle loop: nothing to record yet, keep what came
            step.decided = False
        step = self.step
        # slots freed since the last schedule and still in the step being built came
        # before this schedule's allocations
        step.freed_first += step.freed
        step.freed.clear()
        self.in_schedule = True
        if not step:  # an idle loop's wait is not the step's work
            step.start_ns = time.monotonic_ns()
        for req in self.sched.waiting_queue:  # queued by a path the add hook does not see
            if req.rid not in self.refs:
                self.on_add(req)
        step.arrivals.extend(self.pending_arrivals)
        self.pending_arrivals.clear()
        step.finishes.extend(self.pending_finishes)
        self.pending_finishes.clear()
        self.attempts.clear()

    def upcoming_step(self) -> int:
        """The step the next `get_next_batch_to_run` will build: the one being built ends
        there if it holds something (an idle loop's is dropped)."""
        step = self.step
        return self.next_step + (1 if step.decided and step else 0)

    def on_abort_received(self, reqs: Any) -> None:
        """SGLang received an abort for these requests (a running one finishes at its next
        result, maybe steps later): the step it came before goes into its finish."""
        at = self.upcoming_step()
        for req in reqs:
            ref = self.refs.get(req.rid)
            if ref is not None:
                self.abort_received.setdefault(ref, at)

    def _abort_message(self, ref: int) -> str:
        at = self.abort_received.pop(ref, None)
        return "" if at is None else f"{ABORT_RECEIVED}{at}"

    def on_add(self, req: Any) -> None:
        """A request SGLang queued (a retracted one coming back is known already). Its
        arrival goes into the next step: one aborted before that step is still there."""
        if req.rid in self.refs:
            return
        ref = self.next_ref
        self.next_ref += 1
        self.refs[req.rid] = ref
        self.reqs[ref] = req
        self.status[ref] = Status.WAITING
        self.computed[ref] = 0
        self.seen_outputs[ref] = len(req.output_ids)
        eos = req.eos_token_ids
        self.pending_arrivals.append(
            Arrival(
                ref=ref,
                request_id=str(req.rid),
                num_prompt_tokens=len(req.origin_input_ids),
                priority=int(req.priority or 0),
                arrival_time=float(req.time_stats.scheduler_recv_time or 0.0),
                eos_token_id=min(eos) if eos else None,
                sampling=_sampling(req),
                prompt_token_ids=tuple(map(int, req.origin_input_ids)),
            )
        )

    def after_schedule(self, batch: Any, schedule_ns: int) -> None:
        step = self.step
        self.in_schedule = False
        step.decided = True
        step.schedule_ns += schedule_ns
        if batch is not None:
            mode = batch.forward_mode
            if mode.is_decode():
                reqs = batch.reqs
                known = self._decodes(reqs)
                if self.slot_map:
                    loc = batch.out_cache_loc
                    if known == len(reqs) == int(loc.numel()):  # one slot each, all kept
                        step.allocs += tensor_runs(loc)
                    else:
                        self._allocs(batch, None)
            elif mode.is_extend():
                self._extends(batch, bool(mode.is_mixed()))
                if self.slot_map:
                    self._allocs(batch, [int(r.extend_len) for r in batch.reqs])
        refs = self.refs
        step.waiting = [refs[r.rid] for r in self.sched.waiting_queue if r.rid in refs]
        step.waiting_stop = None
        if step.waiting:
            head = self.sched.waiting_queue[0]
            why = _WAIT_REASON.get(self.attempts.get(head.rid, ""))
            if why is None and self.sched.running_batch.batch_is_full:
                why = Reason.MAX_NUM_SEQS
            if why is not None:  # the rest wait as schedtop's scheduler would say (S7)
                step.waiting_stop = queue_stop(why)

    def _allocs(self, batch: Any, lens: list[int] | None) -> None:
        """The slots SGLang gave the batch (its out_cache_loc: each request's new tokens'
        slots, in batch order, as the entries were recorded), less those of requests the
        trace no longer has."""
        loc = batch.out_cache_loc
        refs = self.refs
        keep = [r.rid in refs for r in batch.reqs]
        if lens is None:
            lens = [1] * len(keep)
        if sum(lens) != int(loc.numel()):
            raise ValueError(f"{int(loc.numel())} slots allocated for {sum(lens)} tokens")
        if not all(keep):
            import torch

            parts, at = [], 0
            for n, kept in zip(lens, keep):
                if kept:
                    parts.append(loc[at : at + n])
                at += n
            loc = torch.cat(parts) if parts else loc[:0]
        self.step.allocs += tensor_runs(loc)

    def on_free(self, free_index: Any) -> None:
        """Slots back in SGLang's free list (a request released, the radix cache's
        duplicates, evictions, retractions). A copy: the tensor may be a view of a row
        that SGLang reuses before the step is written: a list where the slots are few
        (an eviction's leaf, a request's decode tail), which costs less than a tensor's
        copy and sorts in Python at the step's end for less than torch's operations."""
        freed = self.step.freed_first if self.in_schedule else self.step.freed
        flat = free_index.reshape(-1)
        freed.append(flat.tolist() if len(flat) <= _FEW_SLOTS else flat.clone())

    def on_checkpoint(self, req: Any, protected_before: int) -> None:
        """The radix cache took a request's computed tokens: its row from the protected
        prefix on now holds the cache's slots (its own, or the cache's where it held the
        same tokens already; those duplicates were freed)."""
        ref = self.refs.get(req.rid)
        after = int(req.kv.cache_protected_len)
        # a finished request's row goes with its finish: nothing to write (its slots stay
        # the cache's, or were freed, which on_free has)
        if ref is None or after <= protected_before or req.kv.req_pool_idx is None:
            return
        if req.finished():
            return
        row = self.sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        runs = tensor_runs(row[protected_before:after])
        self.step.writes.append(SlotWrite(ref, protected_before, tuple(runs)))

    def _decodes(self, reqs: Any) -> int:
        """Records a decode batch; how many of its requests the trace still has."""
        step, refs, computed = self.step, self.refs, self.computed
        # requests that finished already (their late result was recorded) have no ref
        decodes = [r for r in map(refs.get, map(_RID, reqs)) if r is not None]
        before = list(map(computed.__getitem__, decodes))
        step.decodes += decodes
        step.decodes_before += before
        for ref, n in zip(decodes, before):
            computed[ref] = n + 1
        return len(decodes)

    def _extends(self, batch: Any, mixed: bool) -> None:
        step, refs = self.step, self.refs
        chunked = self.sched.chunked_req
        for req in batch.reqs:
            ref = refs.get(req.rid)
            if ref is None:
                continue
            status = self.status[ref]
            if mixed and status == Status.RUNNING and req is not chunked and req.extend_len == 1:
                step.scheduled.append(Scheduled(ref, 1, Kind.DECODE, self.computed[ref]))
                self.computed[ref] += 1
                continue
            before = int(req.prefix_len)
            if status != Status.RUNNING:  # admitted: from waiting, or back after a retraction
                step.admissions.append(Admission(ref, before, resumed=status == Status.PREEMPTED))
                if before and self.slot_map:  # its radix-cache prefix: the cache's slots
                    row = self.sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
                    step.writes.append(SlotWrite(ref, 0, tuple(tensor_runs(row[:before]))))
                self.status[ref] = Status.RUNNING
                self.running.append(ref)
            n = int(req.extend_len)
            kind = Kind.CHUNK if req is chunked else Kind.PREFILL
            step.scheduled.append(Scheduled(ref, n, kind, before))
            self.computed[ref] = before + n

    def on_retract(self, reqs: Any) -> None:
        step = self.step
        for req in reqs:
            ref = self.refs.get(req.rid)
            if ref is None:
                continue
            step.preemptions.append(
                Preemption(ref, ref, self.computed[ref], cause=Reason.RETRACTED)
            )
            self.status[ref] = Status.PREEMPTED
            self.computed[ref] = 0
            self.running.remove(ref)

    def on_evict(self, slots: int) -> None:
        # counted where they happen (an allocation in the schedule, a finished request's
        # insert), into the step being built: the evictions between one step's record
        # and the next schedule belong to the next step, as its other events do
        self.step.evicted += slots

    def on_abort(self, req: Any) -> None:
        """A waiting request aborted between two steps (a running one finishes with
        FINISH_ABORT in its next result)."""
        ref = self.refs.pop(req.rid, None)
        if ref is not None:
            self.abort_received.setdefault(ref, self.upcoming_step())
            message = self._abort_message(ref)
            self._forget(ref)
            self.pending_finishes.append(Finish(ref, Status.FINISHED_ABORTED, message))

    def _forget(self, ref: int) -> None:
        self.reqs.pop(ref, None)
        self.abort_received.pop(ref, None)
        self.status.pop(ref, None)
        self.computed.pop(ref, None)
        self.seen_outputs.pop(ref, None)
        if ref in self.running:
            self.running.remove(ref)

    def on_result(self, batch: Any, update_ns: int) -> None:
        step = self.step
        step.update_ns += update_ns
        get, seen_outputs, samples = self.refs.get, self.seen_outputs, step.samples
        for req in batch.reqs:
            ref = get(req.rid)
            if ref is None:
                continue
            seen = seen_outputs[ref]
            out = req.output_ids
            n = len(out)
            if n > seen:
                new = list(map(int, out[seen:]))
                had = samples.get(ref)
                if had is None:
                    samples[ref] = new
                else:
                    had += new
                seen_outputs[ref] = n
            if req.finished():
                reason = type(req.finished_reason).__name__
                status = _FINISHED.get(reason, Status.FINISHED_ERROR)
                message = "" if status != Status.FINISHED_ERROR else reason
                if status == Status.FINISHED_ABORTED:
                    message = self._abort_message(ref)
                step.finishes.append(Finish(ref, status, message))
                del self.refs[req.rid]
                self._forget(ref)

    def end_step(self) -> None:
        step = self.step
        self.step = _Step()
        gone = {f.ref for f in step.finishes}
        num_decodes, entries = self._entries(step)
        samples = step.samples
        refs = step.decodes if num_decodes else []
        if entries:
            refs = refs + [e.ref for e in entries]
        got = list(map(samples.pop, refs, repeat((), len(refs))))  # each entry's, in order
        per_entry = list(map(len, got))
        tokens = tuple(chain.from_iterable(got))
        others = tuple(Sample(ref, len(t), tuple(t)) for ref, t in samples.items())
        running, waiting = tuple(self.running), tuple(step.waiting)
        if gone:
            running = tuple(r for r in running if r not in gone)
            waiting = tuple(r for r in waiting if r not in gone)
        # nothing but the running queue's head decoding, one sample each, the queues as
        # they were: the reducer's steady path gives the tap's state the same change
        steady = (
            num_decodes
            and not (entries or step.arrivals or step.admissions or step.preemptions)
            and not (step.finishes or others)
            and per_entry.count(1) == len(per_entry)
            and running == self.last_running
            and waiting == self.last_waiting
        )
        self.last_running, self.last_waiting = running, waiting
        sched = self.sched
        free = int(sched.token_to_kv_pool_allocator.available_size())
        cache = sched.tree_cache
        evictable = int(cache.evictable_size())
        protected = int(cache.protected_size())
        record = Step(
            step=self.next_step,
            schedule_ns=step.schedule_ns,
            update_ns=step.update_ns,
            token_budget=self.config.max_num_batched_tokens,
            arrivals=tuple(step.arrivals),
            num_decodes=num_decodes,
            scheduled=entries,
            admissions=tuple(step.admissions),
            preemptions=tuple(step.preemptions),
            waiting_stop=step.waiting_stop,
            finishes=tuple(step.finishes),
            sample_counts=tuple(per_entry),
            sampled_tokens=tokens,
            other_samples=others,
            # the block map is not tracked (kv_pool "tokens"): every block stays free
            free_blocks_after_schedule=self.config.num_blocks - 1,
            free_blocks=self.config.num_blocks - 1,
            running=running,
            waiting=waiting,
            free_slots=free + evictable,
            cached_slots=evictable + protected,
            evicted_slots=step.evicted,
            slot_allocs=tuple(step.allocs),
            slot_writes=tuple(step.writes),
            slots_freed_first=_sorted_runs(step.freed_first),
            slots_freed=_sorted_runs(step.freed),
            evictable_slots=evictable if self.slot_map else 0,
            # from its get_next_batch_to_run to this record: the batch scheduled, its
            # forward launched, the results before the next processed (format 1.4)
            work_ns=max(time.monotonic_ns() - step.start_ns, 1),
        )
        self.next_step += 1
        self._apply(record, step.decodes if steady else None)
        recorder = self.recorder
        if recorder is None:
            return
        recorder.on_step(record)
        if recorder.error is not None:
            self.stop(recorder.error)
        elif not self.running and not sched.waiting_queue:
            recorder.flush()  # idle: a reader sees every step so far
            if self.cost_file is not None:
                self.write_cost(self.cost_file)

    def _apply(self, record: Step, steady: list[int] | None) -> None:
        """The record applied to the tap's state, the state the trace builds (raises on a
        record that does not fit it). A steady step (`steady`: its decoding requests)
        goes through the reducer's steady path as a record of its decodes and samples
        alone: the same change to the requests and queues, for a fraction of the general
        path's time, unless a request samples its first token (the overlap scheduler's
        first sample comes with its first decode), which the steady path does not mark
        (under SCHEDTOP_STRICT every record goes in full, its slot map checked)."""
        state = self.state
        assert state is not None
        reqs = state.requests
        if steady and state.slots is None and all(map(_OUTPUTS, map(reqs.__getitem__, steady))):
            record = Step(
                record.step,
                num_decodes=record.num_decodes,
                sampled_tokens=record.sampled_tokens,
                free_blocks=record.free_blocks,
            )
        apply(state, record)

    def _entries(self, step: _Step) -> tuple[int, tuple[Scheduled, ...]]:
        """The step's implicit decodes and explicit entries: its decodes are implicit when
        they are the last record's running queue's head, in order, and no abort took a
        request out of it (the compactor's own rule, so the record is the same)."""
        decodes = step.decodes
        if not decodes:
            return 0, tuple(step.scheduled)
        n = len(decodes)
        if (
            not step.scheduled
            and tuple(decodes) == self.last_running[:n]
            and not any(f.status == Status.FINISHED_ABORTED for f in step.finishes)
        ):
            return n, ()
        dec = Kind.DECODE
        explicit = (Scheduled(r, 1, dec, b) for r, b in zip(decodes, step.decodes_before))
        return 0, (*explicit, *step.scheduled)

    def write_cost(self, path: Path) -> None:
        """The recorder's CPU time so far, beside its process's, as one JSON object that
        replaces the last (bench/sglang_record_bench.py reads it between its rounds)."""
        import json
        import threading

        started = time.thread_time_ns()
        timer_ns = 0
        for thread in threading.enumerate():  # the Recorder's flush timer (its _Ticker)
            if thread.name == "trace-flush-timer" and thread.native_id is not None:
                with open(f"/proc/self/task/{thread.native_id}/schedstat") as f:
                    timer_ns += int(f.read().split()[0])
        self.cost_seq += 1
        cost = {
            "seq": self.cost_seq,
            "steps": self.next_step,
            "hooks_ns": self.cpu_ns,
            "timer_ns": timer_ns,
            "process_ns": time.process_time_ns(),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(cost))
        os.replace(tmp, path)
        # the bench's accounting is not recording's: the hook leaves it out of its count
        self.cost_write_ns += time.thread_time_ns() - started

    def snapshot(self) -> Snapshot:
        assert self.state is not None
        snap = self.state.to_snapshot()
        if not self.slot_map:
            return snap
        rows, free, evictable = self.live_slots()
        live = dataclasses.replace(
            snap, slot_rows=rows, free_slot_runs=free, evictable_slots=evictable
        )
        if self.state.slots is not None and live != snap:  # strict: the trace's own pool
            raise ValueError(f"SGLang's token pool after step {snap.step} is not the trace's")
        return live

    def live_slots(self) -> tuple[tuple[SlotWrite, ...], tuple[int, ...], int]:
        """SGLang's token pool as a snapshot holds it: each running request's row up to its
        computed tokens, the allocator's free slots (sorted, as runs), the radix cache's
        evictable count. Read at a step's end, as the step's record was."""
        assert self.state is not None
        sched = self.sched
        table = sched.req_to_token_pool.req_to_token
        requests = self.state.requests
        rows = []
        for ref in sorted(self.state.running):
            idx = self.reqs[ref].kv.req_pool_idx
            row = table[idx, : requests[ref].num_computed_tokens]
            rows.append(SlotWrite(ref, 0, tuple(tensor_runs(row))))
        pool = sched.token_to_kv_pool_allocator
        free = _sorted_runs([pool.free_pages, pool.release_pages])
        return tuple(rows), free, int(sched.tree_cache.evictable_size())
