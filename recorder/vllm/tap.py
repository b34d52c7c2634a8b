"""The recording state of one vLLM scheduler: what each step decided, built into
schedtop's step records and handed to the Recorder (converter and background writer).

A steady decode step (every running request decodes one token, nothing arrives, finishes,
waits or is preempted) takes a short path: no per-request record is built; the step goes
to the trace as a count and the sampled tokens, read with C-level passes over vLLM's
SchedulerOutput and outputs. Any other step builds every entry, as schedtop's engine does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from itertools import chain, compress, count, islice, repeat
from operator import attrgetter, is_not, ne
from pathlib import Path
from typing import Any

from engine.records import (
    MID_STEP_ABORT,
    Admission,
    Arrival,
    Finish,
    Kind,
    KVEvents,
    Preemption,
    QueueStop,
    Reason,
    RequestState,
    Sample,
    SamplingParams,
    Scheduled,
    Shortfall,
    Snapshot,
    Status,
    Step,
    ns,
)
from engine.rules import (
    cut_short,
    entry_kind,
    layout_samples,
    long_prefill_cap,
    one_each,
    queue_stop,
    running_kv_stop,
    waiting_limit,
)
from recorder.recorder import RecordedEngine, Recorder, RecorderOptions, TapEngine
from recorder.vllm.checks import (
    UnsupportedVllm,
    engine_config,
    env_flag,
    env_number,
    request_problem,
)
from recorder.vllm.kv import FULL, IDLE, LEAN, MIXED, STOPPED, KVReq, KVTaps
from recorder.vllm.lazyhash import computed, whole
from recorder.writer import TraceWriter

log = logging.getLogger("schedtop.recorder.vllm")

# Snapshot placement inside vLLM: by cost, snapshots taking at most this share of the
# engine thread's CPU time in vLLM's schedule() and update, and at most this many steps
# apart.
SNAPSHOT_BUDGET = 0.0025
SNAPSHOT_INTERVAL = 4096

# vLLM's finished statuses by name (their values differ between releases).
_FINISHED = {
    "FINISHED_STOPPED": Status.FINISHED_STOPPED,
    "FINISHED_LENGTH_CAPPED": Status.FINISHED_LENGTH_CAPPED,
    "FINISHED_ABORTED": Status.FINISHED_ABORTED,
    "FINISHED_IGNORED": Status.FINISHED_ERROR,
    "FINISHED_ERROR": Status.FINISHED_ERROR,
}
_UNFINISHED = {
    "WAITING": Status.WAITING,
    "RUNNING": Status.RUNNING,
    "PREEMPTED": Status.PREEMPTED,
}
# C-level reads of vLLM's requests and outputs, for the steady-step checks.
_OUTPUT_IDS = attrgetter("_output_token_ids")
_NEW_TOKENS = attrgetter("new_token_ids")
_BLOCK_ID = attrgetter("block_id")
_RID = attrgetter("request_id")
_FINISH_REASON = attrgetter("finish_reason")
_REF = attrgetter("ref")


class _Step:
    """What one step has seen so far."""

    __slots__ = (
        "index",
        "budget",
        "pre_running",
        "run_used",
        "scheduled",
        "shortfalls",
        "admissions",
        "preemptions",
        "pending",
        "wait_fail",
        "decided",
        "schedule_ns",
        "arrivals",
        "entries",
        "running_stop",
        "waiting_stop",
        "free_after_schedule",
        "finishes",
        "samples",
        "steady_tokens",
        "batch",
        "unsettled",
        "decode_refs",
        "decode_ids",
        "decode_tokens",
        "decode_skips",
        "skip_refs",
        "gone",
        "admitted",
        "start_ns",
    )

    def __init__(self, index: int, budget: int, pre_running: list[Any]) -> None:
        self.index = index
        self.budget = budget  # tokens left in the step's budget
        self.pre_running = pre_running  # vLLM's running requests when schedule() began
        self.run_used = 0  # tokens the running pass scheduled (net of give-backs)
        self.scheduled: dict[str, int] = {}  # allocations that succeeded, by request
        self.shortfalls: list[Shortfall] = []
        self.admissions: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.pending: tuple[str, int, Reason | None] | None = None  # (id, wanted, reason)
        self.wait_fail: Reason | None = None  # why the head of waiting was not admitted
        self.decided = False  # schedule() has returned
        self.schedule_ns = 0  # time in schedule()
        # When the step's work began (time.monotonic_ns, the Recorder's clock): at its
        # schedule(), so that the wait for requests before it is idle, not work.
        self.start_ns = 0
        self.arrivals: tuple[Arrival, ...] = ()  # added before schedule()
        # What schedule() decided, in order; None while the step is steady (the entries
        # are then pre_running, each decoding one token, built only if needed).
        self.entries: tuple[Scheduled, ...] | None = ()
        self.running_stop: QueueStop | None = None
        self.waiting_stop: QueueStop | None = None
        self.free_after_schedule = 0  # free blocks right after schedule()
        self.finishes: list[Finish] = []  # aborts before schedule(), then the rest
        self.samples: dict[int, tuple[int, ...]] = {}  # ref -> tokens that arrived
        self.steady_tokens: tuple[int, ...] | None = None  # steady: one token per entry
        self.batch: Any = None  # steady: the SchedulerOutput schedule() returned
        # MIXED, in the waiting pass: (ref, wanted, tokens, budget before the running
        # pass's tokens) per admission, whose shortfall waits for that budget (_settle).
        self.unsettled: list[tuple[int, int, int, int]] | None = None
        # MIXED: the leading running requests, each decoding one token, left implicit
        # (the record's num_decodes); `entries` then holds only the rest.
        self.decode_refs: list[int] = []
        self.decode_ids: list[str] = []  # their request ids
        self.decode_tokens: tuple[int, ...] | None = None  # one sampled by each, if read so
        # Async: running requests the running pass did not schedule (the last token in
        # flight) among the implicit decodes, passed over (the record's decode_skips).
        self.decode_skips: list[str] = []  # their request ids
        self.skip_refs: tuple[int, ...] = ()  # their refs (a finish forgets the ids' refs)
        # The requests that left running (finished, preempted) and joined it (admitted,
        # with their ids and refs), to update the tap's copy of the running queue.
        self.gone: list[Any] = []
        self.admitted: list[tuple[Any, str, int]] = []


class Tap(KVTaps, TapEngine):
    """All the recording state, kept apart from vLLM's scheduler attributes."""

    def __init__(self, sched: Any, is_async: bool, block_size: int, num_blocks: int) -> None:
        super().__init__(sched, block_size)
        self.config = engine_config(sched, is_async, block_size, num_blocks)
        self.is_async = is_async
        self.live: dict[str, Any] = {}  # request id -> vLLM request, until it finishes
        self.next_ref = 0
        # ref -> [arrival_step, first_scheduled_step, first_token_step, prefix-hit tokens]
        self.progress: dict[int, list[int]] = {}
        self.arrivals: list[Arrival] = []
        self.finishes: list[Finish] = []
        self.step: _Step | None = None
        self.next_step = 0
        self.last_end_ns = time.monotonic_ns()  # when the last step's record was made
        self.last_flush = time.monotonic()
        self.flush_interval = env_number("SCHEDTOP_FLUSH_INTERVAL_S", 1.0)
        self.stopped: str | None = None  # why recording stopped
        # The engine thread's CPU time in vLLM's own schedule() and update_from_output()
        # (the taps inside them included, the tap's hooks around them not): what pays
        # for the snapshots under their budget.
        self.vllm_cpu_ns = 0
        self.redact = env_flag("SCHEDTOP_REDACT_PROMPTS")
        # The step records' destination: a Recorder (one file), or the segments'
        # owner (recorder.vllm.live.VllmRecording), which takes the same calls.
        self.recorder: Any = None
        self.writer: TraceWriter | None = None
        self.description = ("", "")  # (engine, model) for the trace's header
        self.threshold = 0  # the step's long-prefill cap (0: off)
        self.in_flight = 0  # async: batches scheduled and not updated yet
        self.lean_steps = 0  # steps scheduled without the allocate_slots tap
        self.steady_steps = 0  # steps recorded by the steady shortcut
        self.mixed_steps = 0  # steps whose running pass was scheduled without the tap
        self.implicit_steps = 0  # MIXED steps whose leading decodes were left implicit
        self.awaiting_first: set[int] = set()  # refs of live requests yet to sample
        # Requests admitted (or resumed) from waiting and not yet seen past their prompt:
        # only these can be a prefill chunk in running, so pass_mode looks at them, not
        # at every running request after each step that admitted one.
        self.prefilling: dict[str, Any] = {}
        # vLLM's running queue as of the last step's end, with the requests' ids and refs
        # in the same order: kept up to date from each step's changes and checked against
        # vLLM's by identity (a pass of pointer comparisons), so that a step that admits
        # or finishes a request does not look up every running request's id and ref.
        self.run_reqs: list[Any] = []
        self.run_ids: list[str] = []
        self.run_refs: list[int] = []
        self.run_rebuilds = 0  # times the copy did not match and was made again
        self.sampling_cache: dict[tuple[Any, ...], SamplingParams] = {}
        from vllm.v1.request import RequestStatus

        self.sched_running_status = RequestStatus.RUNNING
        # Run the KV operations at each step's end on the engine thread, as the
        # recording did before they moved off it (tests compare the two).
        self.kv_inline = False
        # The last step was steady: every running request has sampled and is past its
        # prefill, and stays so until it finishes (only admissions add to running).
        self.decoding = False

    # -- opening and closing ---------------------------------------------------------------

    def open(self, path: Path, engine_name: str, model: str, on_record: Any) -> None:
        self.writer = TraceWriter(path, live=False, flush_interval_s=self.flush_interval)
        self.description = (engine_name, model)
        try:
            self.recorder = Recorder(self, self.writer, self._options(on_record), install=False)
        except ValueError as e:
            raise UnsupportedVllm(
                f"schedtop's recorder settings (SCHEDTOP_SNAPSHOT_*, "
                f"SCHEDTOP_FLUSH_INTERVAL_S): {e}"
            ) from None
        self.install_kv()

    def open_segments(
        self,
        settings: Any,
        dp_rank: int | None,
        engine_name: str,
        model: str,
        on_record: Any,
        lock: Any = None,
    ) -> Path:
        """Record into rotating segments, as `schedtop serve` does (recorder.vllm.live:
        SCHEDTOP_TRACE_MAX_BYTES, SCHEDTOP_LIVE_PORT); returns the run directory."""
        from recorder.vllm.live import open_segmented

        self.description = (engine_name, model)
        options = self._options(on_record)

        def new_recorder(
            core: RecordedEngine, writer: TraceWriter, previous: Recorder | None
        ) -> Recorder:
            # A segment after the first (recorder.vllm.live) continues the one before;
            # the owner of the segments passes records on, so none is installed.
            return Recorder(core, writer, options, install=False, continue_from=previous)

        try:
            recording = open_segmented(self, settings, dp_rank, new_recorder, lock)
        except ValueError as e:
            raise UnsupportedVllm(
                f"schedtop's recorder settings (SCHEDTOP_SNAPSHOT_*, "
                f"SCHEDTOP_FLUSH_INTERVAL_S): {e}"
            ) from None
        self.recorder = recording
        self.install_kv()
        return recording.directory

    def _options(self, on_record: Any) -> RecorderOptions:
        return RecorderOptions(
            redact_prompts=self.redact,
            snapshot_interval=int(env_number("SCHEDTOP_SNAPSHOT_INTERVAL", SNAPSHOT_INTERVAL)),
            # Not by replay work unless asked: inside a production server the trace's bytes
            # and the step's cost come first, and work-placed snapshots at a few hundred
            # running requests come 4x as often (docs/benchmarks.md, Recording inside vLLM).
            snapshot_work=int(env_number("SCHEDTOP_SNAPSHOT_WORK", 0)),
            # By cost: a snapshot lists every free and cached block, so at a fixed step count
            # a large pool under light load spent more on snapshots than on its steps.
            snapshot_budget=env_number("SCHEDTOP_SNAPSHOT_BUDGET", SNAPSHOT_BUDGET),
            # The budget's share of vLLM's own CPU time in schedule() and update (the
            # scheduler mixin reads the thread's CPU clock around them), not of the steps'
            # wall time, which a loaded machine stretches several times. Not the thread's
            # whole CPU time either: that counts the model's step (and, in the benchmark,
            # the plain scheduler stepped on the same thread).
            budget_clock=self._vllm_cpu,
            on_step_record=None if on_record is None else lambda s: on_record(computed(s)),
            # Encoding a record costs about as much as all else the recorder does in a
            # step; on a thread of its own it overlaps vLLM's model step.
            background=True,
            # That thread also flushes on a timer: vLLM calls the scheduler only while it
            # steps, and a hung engine core that is killed must keep its last steps.
            flush_interval_s=self.flush_interval,
        )

    def _vllm_cpu(self) -> int:
        return self.vllm_cpu_ns

    def close(self, stopped: str = "") -> None:
        if self.recorder is not None:
            self.recorder.close(stopped)
            self.recorder = None

    def stop(self, why: str) -> None:
        """Stop recording for good (the engine goes on); the file keeps what it has."""
        if self.stopped is None:
            self.stopped = why
            log.warning("schedtop recording stopped: %s", why)
            self.close(why)  # the footer says why the trace ends before vLLM did
            if self.raw_allocate is not None:  # nothing to record any more
                self.set_mode(STOPPED)
            self.mode = STOPPED

    def flush(self) -> None:
        if self.recorder is not None and self.stopped is None:
            self.recorder.flush()
        self.last_flush = time.monotonic()

    # -- the decisions -------------------------------------------------------------------------

    def _count_running(self, step: _Step, rid: str, n: int) -> None:
        """A running request's successful allocation (FULL mode)."""
        pending = step.pending
        if pending is not None and pending[0] == rid:
            step.pending = None
            if pending[2] is not None:
                step.shortfalls.append(Shortfall(self.refs[rid], pending[1], n, pending[2]))
        step.scheduled[rid] = n
        step.budget -= n
        step.run_used += n

    def _count_allocation(self, step: _Step, request: Any, n: int, num_hits: int) -> None:
        """An admission from waiting (running requests take the fast path)."""
        rid = request.request_id
        wanted = request.num_tokens - num_hits
        ref = self.refs[rid]
        if step.unsettled is not None:  # the running pass's share is not known yet
            step.unsettled.append((ref, wanted, n, step.budget))
        else:
            reason = self._short_of(wanted, step.budget)
            if reason is not None:
                step.shortfalls.append(Shortfall(ref, wanted, n, reason))
        step.admissions.append(Admission(ref, num_hits, request.status.name == "PREEMPTED"))
        step.admitted.append((request, rid, ref))
        self.prefilling[rid] = request
        progress = self.progress[ref]
        if progress[1] < 0:
            progress[1] = step.index
            progress[3] = num_hits
        step.scheduled[rid] = n
        step.budget -= n

    def _short_of(self, wanted: int, budget: int) -> Reason | None:
        """Why an admitted request got fewer tokens than it wanted (None: it did not)."""
        return cut_short(wanted, self.threshold, budget, wanted)[1]

    def _settle(self, step: _Step, out: Any) -> None:
        """MIXED: the running pass's tokens, now that the SchedulerOutput tells them (all
        but the admitted and resumed requests' tokens), and the waiting pass's shortfalls
        with the budget that was really left at each admission."""
        cached = out.scheduled_cached_reqs
        counts = out.num_scheduled_tokens
        others = sum(counts[r] for r in cached.resumed_req_ids)
        others += sum(counts[r.req_id] for r in out.scheduled_new_reqs)
        used = out.total_num_scheduled_tokens - others
        step.run_used = used
        step.budget -= used
        for ref, wanted, n, budget in step.unsettled or ():
            reason = self._short_of(wanted, budget - used)
            if reason is not None:
                step.shortfalls.append(Shortfall(ref, wanted, n, reason))
        step.unsettled = None

    def _running_share(self, step: _Step, request: Any, n: int) -> tuple[str, int, Reason | None]:
        """A running request's wanted tokens and why it got fewer (schedtop's rules), as
        the budget stands at its first allocation attempt."""
        computed = request.num_computed_tokens
        wanted = request.num_tokens_with_spec + request.num_output_placeholders - computed
        if n == wanted:
            return (request.request_id, wanted, None)
        room = self.config.max_model_len - 1 - computed
        _, reason = cut_short(wanted, self.threshold, step.budget, room)
        return (request.request_id, wanted, reason)

    def on_preempt(self, victim: Any) -> None:
        step = self.step
        if step is None:
            self.stop("a preemption outside schedule() (reset_prefix_cache with running requests)")
            return
        if self.mode in (LEAN, MIXED):
            # pass_mode() rules this out (every running request fits a new block).
            self.stop("a preemption in a step recorded without the allocation tap")
            return
        rid = victim.request_id
        ref = self.refs[rid]
        step.gone.append(victim)
        given_back = step.scheduled.pop(rid, 0)
        if given_back:
            step.budget += given_back
            step.run_used -= given_back
            step.shortfalls = [s for s in step.shortfalls if s.ref != ref]
        for_request = self.refs.get(self.alloc_for or rid, ref)
        step.preemptions.append(
            Preemption(ref, for_request, victim.num_computed_tokens, given_back)
        )

    # -- the scheduler's calls -----------------------------------------------------------------

    def on_add(self, request: Any) -> None:
        problem = request_problem(request)
        if problem:
            self.stop(f"request {request.request_id!r} uses {problem}, which is not recorded")
            return
        rid = request.request_id
        ref = self.next_ref
        self.next_ref += 1
        self.refs[rid] = ref
        st = KVReq(ref)
        self.kvreqs[rid] = st
        self.defer((self.wreqs.__setitem__, (rid, st)))
        self.live[rid] = request
        self.progress[ref] = [self.next_step, -1, -1, -1]
        self.awaiting_first.add(ref)
        sp = request.sampling_params
        prompt = tuple(request.prompt_token_ids or ())
        full = len(prompt) // self.block_size
        self.arrivals.append(
            Arrival(
                ref,
                rid,
                len(prompt),
                int(request.priority),
                float(request.arrival_time),
                sp.eos_token_id,
                self._sampling(
                    request.max_tokens,
                    float(sp.temperature),
                    float(sp.top_p),
                    max(int(sp.top_k or 0), 0),
                    sp.seed,
                    tuple(sp.stop_token_ids or ()),
                ),
                prompt,
                tuple(map(whole, self.prompt_hashes(st, request, full))) if self.redact else None,
            )
        )

    def _sampling(self, *key: Any) -> SamplingParams:
        """The trace's SamplingParams for these values: one (frozen) object per distinct
        set, since a server's requests mostly share theirs and building one checks each
        field's range (most of what an arrival cost)."""
        cache = self.sampling_cache
        params = cache.get(key)
        if params is None:
            max_tokens, temperature, top_p, top_k, seed, stop = key
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop_token_ids=stop,
                ignore_eos=False,  # vLLM clears eos_token_id instead
            )
            if len(cache) >= 1024:  # bounded: a workload of all-distinct settings
                cache.clear()
            cache[key] = params
        return params

    def on_finished(self, requests: Iterable[Any], status: Any) -> None:
        """Requests finished from outside (aborts, stop strings): before the next
        schedule(), or between schedule() and update (then the message says so)."""
        step = self.step
        mid_step = step is not None and step.decided
        if mid_step and step is not None and step.entries is None:
            self._build_steady_entries(step)  # before the aborted requests are forgotten
        elif mid_step and step is not None:
            self._expand_decodes(step)
        for req in requests:
            ours = _FINISHED.get(req.status.name, Status.FINISHED_ABORTED)
            message = MID_STEP_ABORT if mid_step else ""
            if ours != Status.FINISHED_ABORTED:
                message = (message + "; " if message else "") + f"vLLM {req.status.name}"
            ref = self.refs.get(req.request_id)
            if ref is None:
                continue
            finish = Finish(ref, Status.FINISHED_ABORTED, message)
            if mid_step and step is not None:
                step.finishes.append(finish)
                step.gone.append(req)
            else:
                self.finishes.append(finish)
            self._forget(req.request_id)

    def _forget(self, rid: str) -> None:
        self.live.pop(rid, None)
        self.prefilling.pop(rid, None)
        ref = self.refs.pop(rid, None)
        if ref is not None:
            self.progress.pop(ref, None)
            self.awaiting_first.discard(ref)
        if self.kvreqs.pop(rid, None) is not None:
            self.defer((self.wreqs.pop, (rid, None)))

    def pass_mode(self, running: list[Any]) -> int:
        """How this schedule() is tapped. LEAN, without the allocate_slots tap, when no
        request can be admitted (nothing waits), none cut short (each running request has
        finished its prefill, so wants one token: no speculative decoding here) and no
        allocation can fail (a token needs at most one new block, and there are as many
        free blocks as running requests), so no preemption. MIXED when only the first
        does not hold: the running pass is read off the SchedulerOutput as in LEAN (it
        cannot cut short or preempt either, and leaves budget over), and the waiting pass
        (admissions) is tapped. FULL otherwise."""
        sched = self.sched
        if (
            not running
            or getattr(sched, "kv_holding_waiting", None)
            or self.pool.get_num_free_blocks() < len(running)
            or (self.prefilling and self._prefill_chunk_runs())
        ):
            return FULL
        if not self.arrivals and not sched.waiting:
            return LEAN
        return MIXED if self.config.max_num_batched_tokens > len(running) else FULL

    def _prefill_chunk_runs(self) -> bool:
        """Whether a running request is a prefill chunk; forgets the admitted requests
        that are past their prompt (a request preempted since is admitted again)."""
        running = self.sched_running_status
        done = [
            rid
            for rid, r in self.prefilling.items()
            if r.status is not running or not r.is_prefill_chunk
        ]
        for rid in done:
            del self.prefilling[rid]
        return bool(self.prefilling)

    def _rebuild_running(self) -> list[Any]:
        """The copy of vLLM's running queue (and its ids and refs), made afresh."""
        self.run_rebuilds += 1
        self.run_reqs = list(self.sched.running)
        self.run_ids = list(map(_RID, self.run_reqs))
        self.run_refs = list(map(self.refs.__getitem__, self.run_ids))
        return self.run_reqs

    def _update_running(self, step: _Step) -> None:
        """The copy of the running queue after a step: without the requests that left
        it, with those admitted (vLLM keeps the others' order), checked by identity."""
        reqs, ids, refs = self.run_reqs, self.run_ids, self.run_refs
        for req in step.gone:
            try:
                i = reqs.index(req)
            except ValueError:
                continue  # not running (an abort of a waiting request)
            del reqs[i], ids[i], refs[i]
        for req, rid, ref in step.admitted:
            reqs.append(req)
            ids.append(rid)
            refs.append(ref)
        if reqs != self.sched.running:
            self._rebuild_running()

    def end_running_pass(self) -> None:
        super().end_running_pass()
        if self.step is not None:  # its tokens are settled after schedule() (_settle)
            self.step.unsettled = []

    def before_schedule(self) -> None:
        if self.step is not None:
            self.end_step(0)  # the previous step had no update (async queue filling)
        sched = self.sched
        running = self.run_reqs
        if running != sched.running:  # requests aborted since the last step, say
            running = self._rebuild_running()
        cfg = self.config
        self.threshold = long_prefill_cap(
            cfg.long_prefill_token_threshold,
            cfg.long_prefill_token_threshold_adaptive,
            cfg.max_num_batched_tokens,
            len(running) + len(sched.waiting),
        )
        self.step = _Step(self.next_step, cfg.max_num_batched_tokens, running)
        self.step.start_ns = time.monotonic_ns()
        self.set_mode(self.pass_mode(running))
        self.lean_order.clear()
        self.waiting_ops = None
        self.defer = self.ops.append
        self.lean_free = self.free_queue.num_free_blocks

    def after_schedule(self, out: Any, seconds: float, launched: bool = True) -> None:
        if self.stopped is not None:
            return  # stopped during schedule()
        step = self.step
        assert step is not None
        sched = self.sched
        lean = self.mode == LEAN
        mixed = self.mode == MIXED or self.waiting_ops is not None
        if mixed:
            self.mixed_steps += 1
            self.mixed_events(out)
            self._settle(step, out)
        self.mode = IDLE
        if lean:
            self.lean_steps += 1
            self.lean_events(out)
            counts = out.num_scheduled_tokens
            total = out.total_num_scheduled_tokens
            step.scheduled = counts  # read only from here on: no preemption in LEAN
            step.budget -= total
            step.run_used = total
        if lean and not self.finishes and self._steady(step, out):
            step.entries = None  # built only if the step turns out not to be steady
        elif mixed:
            self._mixed_entries(step, out)
        else:
            step.entries = self._entries(out.num_scheduled_tokens.items())
        if self.arrivals:
            step.arrivals = tuple(self.arrivals)
            self.arrivals = []
        if self.finishes:
            step.finishes = self.finishes
            self.finishes = []
        step.running_stop = self._running_stop(step)
        step.waiting_stop = self._waiting_stop(step)
        step.free_after_schedule = self.pool.get_num_free_blocks()
        step.schedule_ns = ns(seconds)
        step.decided = True
        if self.is_async and launched:
            # vLLM's EngineCore (step_with_batch_queue) fills its two-batch queue
            # before it waits for the oldest batch: then no update follows this step.
            self.in_flight += 1
            if self.in_flight < 2 and (out.num_scheduled_tokens or sched.has_requests()):
                self.end_step(0)

    def _steady(self, step: _Step, out: Any) -> bool:
        """Whether a LEAN schedule() gave every running request one DECODE token (as
        schedtop labels it: a request with no sampled token yet is a PREFILL). Then they
        were scheduled in running order: LEAN rules out preemptions and admissions."""
        running = step.pre_running
        counts = out.num_scheduled_tokens
        n = len(running)
        if len(counts) != n or out.total_num_scheduled_tokens != n:
            return False
        if not self.decoding and not all(map(_OUTPUT_IDS, running)):
            return False
        step.batch = out
        return True

    def _entries(self, scheduled: Iterable[tuple[str, int]]) -> tuple[Scheduled, ...]:
        """Entries for (request id, tokens) in scheduling order."""
        requests = self.sched.requests
        refs = self.refs
        entries: list[Scheduled] = []
        append = entries.append
        for rid, n in scheduled:
            req = requests[rid]
            kind = entry_kind(n, req.is_prefill_chunk, req.output_token_ids)
            append(Scheduled(refs[rid], n, kind, req.num_computed_tokens - n))
        return tuple(entries)

    def _mixed_entries(self, step: _Step, out: Any) -> None:
        """A MIXED step's entries: the running requests that the running pass gave one
        DECODE token each, from the first on in running order, left implicit (as a trace
        keeps them), then the rest, spelled out. Two C-level comparisons in the common
        case, instead of an entry per running request."""
        req_ids = out.scheduled_cached_reqs.req_ids
        m = len(req_ids) - len(out.scheduled_cached_reqs.resumed_req_ids)
        k = 0
        skips: list[str] = []
        pre_ids = self.run_ids  # pre's (before_schedule checked pre is run_reqs)
        if step.run_used == m:  # one token each
            k = min(m, len(pre_ids))
            if req_ids[:k] != pre_ids[:k]:  # one skipped (async: it is done in flight)
                k, skips = _skipping(req_ids, pre_ids, m, out.num_scheduled_tokens)
        if skips:
            decode_refs = list(map(self.refs.__getitem__, req_ids[:k]))
        else:
            decode_refs = self.run_refs[:k]
        awaiting = self.awaiting_first
        if awaiting and not awaiting.isdisjoint(decode_refs):
            # Not a DECODE before its first sample (async: just admitted, its prefill is
            # in flight): the implicit decodes stop at the first such request.
            k = min(map(decode_refs.index, awaiting.intersection(decode_refs)))
            del decode_refs[k:]
            if skips:  # only those passed over before the last implicit decode
                last = pre_ids.index(req_ids[k - 1]) if k else -1
                skips = [rid for rid in skips if pre_ids.index(rid) < last]
        if k:
            self.implicit_steps += 1
            step.decode_ids = req_ids[:k]
            step.decode_skips = skips
            step.skip_refs = tuple(map(self.refs.__getitem__, skips))
        step.decode_refs = decode_refs
        step.entries = self._entries(islice(out.num_scheduled_tokens.items(), k, None))

    def _expand_decodes(self, step: _Step) -> None:
        """Spell out a MIXED step's implicit decodes (a request among them is aborted
        before the step ends: then they are not the running queue's head any more)."""
        if step.decode_refs and step.entries is not None:
            # The tap's own map: vLLM has taken an aborted request out of its requests.
            requests = map(self.live.__getitem__, step.decode_ids)
            decodes = _decode_entries(step.decode_refs, requests)
            step.entries = (*decodes, *step.entries)
            step.decode_refs, step.decode_ids, step.decode_skips = [], [], []
            step.skip_refs = ()

    def _build_steady_entries(self, step: _Step) -> None:
        """The entries of a step that was steady until now (each running request, one
        DECODE token), for a step that turns out not to be."""
        refs = map(self.refs.__getitem__, map(_RID, step.pre_running))
        step.entries = _decode_entries(refs, step.pre_running)

    def _running_stop(self, step: _Step) -> QueueStop | None:
        fcfs = self.config.policy == "fcfs"
        if fcfs and step.preemptions and any(p.victim == p.for_request for p in step.preemptions):
            return running_kv_stop()
        if self.config.max_num_batched_tokens - step.run_used > 0:
            return None
        before = {r.request_id for r in step.pre_running}
        still = [r.request_id for r in self.sched.running if r.request_id in before]
        last = max((i for i, rid in enumerate(still) if rid in step.scheduled), default=-1)
        if last < len(still) - 1:
            return queue_stop(Reason.TOKEN_BUDGET)
        return None

    def _waiting_stop(self, step: _Step) -> QueueStop | None:
        sched = self.sched
        if step.preemptions:
            return queue_stop(Reason.PREEMPTION) if sched.waiting else None
        if not sched.waiting:
            return None
        left = any(not r.num_stale_output_tokens for r in sched.waiting)
        if not left:
            return None
        if step.wait_fail is not None:
            return queue_stop(step.wait_fail)
        cfg = self.config
        limit = waiting_limit(
            step.budget, len(sched.running), cfg.max_num_active_seqs or cfg.max_num_seqs
        )
        if limit is None and not cfg.enable_chunked_prefill:
            limit = Reason.NO_CHUNKING
        return None if limit is None else queue_stop(limit)

    def after_update(self, batch: Any, outputs: Any, seconds: float) -> None:
        """The samples and finishes of an executed batch (this step's, or with async
        scheduling the one before), then the end of the step."""
        if self.stopped is not None:
            return
        if self.step is None or not self.step.decided:
            self.before_schedule()  # vLLM updated without scheduling: an empty step
            self.set_mode(FULL)  # nothing is allocated; FULL keeps the wrapper in place
            self.after_schedule(_EmptyOutput(), 0.0, launched=False)
            assert self.step is not None
            # Its work began when the last step ended: a batch was in flight, so vLLM
            # was waiting for the model since then, not idle.
            self.step.start_ns = self.last_end_ns
        step = self.step
        assert step is not None
        if self.is_async:
            self.in_flight = max(self.in_flight - 1, 0)
        if step.entries is None:
            if self._steady_samples(step, batch, outputs):
                self.end_step(ns(seconds))
                return
            self._build_steady_entries(step)
        self._samples(step, outputs)
        self.end_step(ns(seconds))

    def _samples(self, step: _Step, outputs: Any) -> None:
        """The step's samples (ref -> tokens) and finishes from vLLM's outputs, which come
        in the batch's scheduling order (per client): C-level passes over them, and a
        Python loop only over the few that finished."""
        outs = _flat_outputs(outputs)
        k = len(step.decode_ids)
        skipped = len(step.decode_skips)
        if k and len(outs) >= k + skipped:
            # The implicit decodes first, as the batch scheduled them (async: the batch
            # before): their one token each, in one pass, without a sample per request.
            head = outs[: k + skipped]
            rest = outs[k + skipped :]
            if skipped:
                # Async: the batch before still had the requests this step passed over
                # (their last token was in flight); theirs are samples of their own.
                head, aside = _set_aside(head, step.decode_skips)
                rest = [*aside, *rest]
            if list(map(_RID, head)) == step.decode_ids:
                step.decode_tokens = _one_token_each(head)
                if step.decode_tokens is not None:
                    self._finishes(head)
                    outs = rest
        refs = self.refs
        samples: dict[Any, tuple[int, ...]] = step.samples
        tokens = list(map(_NEW_TOKENS, outs))
        samples.update(compress(zip(map(refs.get, map(_RID, outs)), map(tuple, tokens)), tokens))
        samples.pop(None, None)  # a request the trace does not know
        awaiting = self.awaiting_first
        if awaiting and not awaiting.isdisjoint(samples):
            index, progress = step.index, self.progress
            for ref in awaiting.intersection(samples):
                progress[ref][2] = index
            awaiting.difference_update(samples)
        self._finishes(outs)

    def _finishes(self, outs: Any) -> None:
        step = self.step
        assert step is not None
        refs = self.refs
        # C-level: a step's outputs are mostly unfinished (FinishReason.STOP is 0: no
        # truth test, `is not None`).
        for o in compress(outs, map(is_not, map(_FINISH_REASON, outs), repeat(None))):
            done = refs.get(o.request_id)
            if done is None:
                continue
            req = self.live.get(o.request_id)
            if req is not None:
                step.gone.append(req)
            status = _FINISHED.get(req.status.name if req is not None else "")
            step.finishes.append(Finish(done, status or Status.FINISHED_ERROR, ""))
            self._forget(o.request_id)

    def _steady_samples(self, step: _Step, batch: Any, outputs: Any) -> bool:
        """Whether a steady step's outputs are one token for each of its requests, in its
        order, and no finish (then they are kept as the step's tokens)."""
        running = step.pre_running
        n = len(running)
        if len(self.sched.running) != n:
            return False  # a request finished
        # With async scheduling, the previous batch's outputs, in its scheduling order,
        # which must be this step's order.
        if batch is not step.batch and not _same_order(batch, step.batch):
            return False
        outs = _flat_outputs(outputs)
        if len(outs) != n:
            return False
        step.steady_tokens = _one_token_each(outs)
        return step.steady_tokens is not None

    def end_step(self, update_ns: int) -> None:
        step = self.step
        assert step is not None
        self.step = None
        # The engine's work in the step, schedule() to now: with async scheduling that
        # takes in the wait for the batch before (its update ends the step), as schedtop's
        # own engine counts an async step. Idle time before schedule() is not in it.
        now = time.monotonic_ns()
        work_ns = max(now - step.start_ns, 1)
        self.last_end_ns = now
        steady = step.entries is None
        if not steady:
            self._update_running(step)
        # Built by whoever reads them first: the encoding thread, as a rule.
        kv_events: Any = self.freeze_kv()
        if self.kv_inline:
            self.run_ops()
        record = None if steady else self._general_record(step, update_ns, kv_events, work_ns)
        self.decoding = steady
        self.next_step += 1
        recorder = self.recorder
        if recorder is None or self.stopped is not None:
            return
        if self.kv_failed is not None:
            self.stop(self.kv_failed)
            return
        if record is None:
            self._steady_record(recorder, step, update_ns, kv_events, work_ns)
        else:
            recorder.on_step(record)
        # After the record's time_ns: a step that starts here starts after it.
        self.last_end_ns = time.monotonic_ns()
        if recorder.error is not None:
            self.stop(recorder.error)
        elif not self.sched.has_unfinished_requests() or (
            time.monotonic() - self.last_flush >= self.flush_interval
        ):
            self.flush()  # idle, or due: a reader sees every step so far

    def _steady_record(
        self, recorder: Any, step: _Step, update_ns: int, kv_events: KVEvents, work_ns: int
    ) -> None:
        """Already in the trace's compact form: the leading decodes are every running
        request, the queues did not move. An async step with no update yet has no tokens."""
        self.steady_steps += 1
        n = len(step.pre_running)
        tokens = step.steady_tokens
        recorder.on_steady_step(
            step.index,
            step.schedule_ns,
            update_ns,
            self.config.max_num_batched_tokens,
            n,
            None if tokens is not None else (0,) * n,
            tokens if tokens is not None else (),
            kv_events,
            step.free_after_schedule,
            self.pool.get_num_free_blocks(),
            work_ns,
        )

    def _general_record(
        self, step: _Step, update_ns: int, kv_events: KVEvents, work_ns: int
    ) -> Step:
        sched = self.sched
        refs = self.refs
        assert step.entries is not None
        counts, tokens, others = _layout(
            step.decode_refs, step.decode_tokens, step.entries, step.samples
        )
        return Step(
            step=step.index,
            schedule_ns=step.schedule_ns,
            update_ns=update_ns,
            token_budget=self.config.max_num_batched_tokens,
            arrivals=step.arrivals,
            num_decodes=len(step.decode_refs),
            decode_skips=step.skip_refs,
            scheduled=step.entries,
            admissions=tuple(step.admissions),
            preemptions=tuple(step.preemptions),
            shortfalls=tuple(step.shortfalls),
            running_stop=step.running_stop,
            waiting_stop=step.waiting_stop,
            finishes=tuple(step.finishes),
            sample_counts=counts,
            sampled_tokens=tokens,
            other_samples=others,
            kv_events=kv_events,
            free_blocks_after_schedule=step.free_after_schedule,
            free_blocks=self.pool.get_num_free_blocks(),
            running=tuple(self.run_refs),  # vLLM's, as _update_running has checked
            waiting=tuple(map(refs.__getitem__, map(_RID, sched.waiting))),
            work_ns=work_ns,
        )

    def snapshot(self) -> Snapshot:
        self.run_ops()  # the mirror as of now (the encoding thread may not be there yet)
        sched = self.sched
        refs = self.refs
        reqs = []
        kvreqs = self.kvreqs
        for rid, r in sched.requests.items():
            ref = refs[rid]
            arrival_step, first_scheduled, first_token, hits = self.progress[ref]
            reqs.append(
                RequestState(
                    ref,
                    rid,
                    _UNFINISHED.get(r.status.name, Status.WAITING),
                    r.num_prompt_tokens,
                    len(_OUTPUT_IDS(r)),
                    r.num_computed_tokens,
                    tuple(kvreqs[rid].ids),
                    r.num_preemptions,
                    r.priority,
                    float(r.arrival_time),
                    hits,
                    r.max_tokens,
                    arrival_step,
                    first_scheduled,
                    first_token,
                )
            )
        reqs.sort(key=lambda r: r.ref)
        free = tuple(map(_BLOCK_ID, self.pool.free_block_queue.get_all_free_blocks()))
        cached_ids = sorted(self.block_hash)
        return Snapshot(
            step=self.next_step - 1,
            next_ref=self.next_ref,
            requests=tuple(reqs),
            running=tuple(refs[r.request_id] for r in sched.running),
            waiting=tuple(refs[r.request_id] for r in sched.waiting),
            free_queue=free,
            cached_block_ids=tuple(cached_ids),
            # bytes(): a LazyHash the encoding thread has not reached yet is computed here
            cached_hashes=tuple(map(bytes, map(self.block_hash.__getitem__, cached_ids))),
        )


def _layout(
    decode_refs: list[int],
    decode_tokens: tuple[int, ...] | None,
    entries: tuple[Scheduled, ...],
    samples: dict[int, tuple[int, ...]],
) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[Sample, ...]]:
    """Samples laid out against the step's entries (the implicit decodes', then the
    others'): per-entry counts (None: one each), the tokens in entry order, and samples
    of requests without an entry (async: the previous batch's, of a request not
    scheduled again). `decode_tokens`: the decodes' one token each, read already."""
    if decode_tokens is None:
        return layout_samples(chain(decode_refs, map(_REF, entries)), samples)
    # The implicit decodes' tokens are read already, one each: only the rest is laid out.
    pop = samples.pop
    rest = [pop(e.ref, ()) for e in entries]
    flat = decode_tokens + tuple(chain.from_iterable(rest))
    others = tuple(Sample(ref, len(toks), toks) for ref, toks in samples.items())
    counts = (*repeat(1, len(decode_tokens)), *map(len, rest))
    if not others and one_each(counts, len(flat), len(counts)):
        return None, flat, ()
    return counts, flat, others


def _skipping(
    req_ids: list[str], pre_ids: list[str], m: int, scheduled: dict[str, int]
) -> tuple[int, list[str]]:
    """The implicit decodes of a running pass that passed over some running requests
    (async: their last token is in flight): how many of the pass's first `m` requests
    (`req_ids`, each one token) follow the running queue `pre_ids` in order once the
    requests it left out are taken out, and those requests (not scheduled at all this
    step). C-level comparisons of the runs between them; at most 8 passed over."""
    k = pos = 0
    skips: list[str] = []
    before: list[int] = []  # implicit decodes before each of them
    n = len(pre_ids)
    while k < m and pos < n:
        run = min(m - k, n - pos)
        a, b = req_ids[k : k + run], pre_ids[pos : pos + run]
        if a == b:
            k += run
            break
        d = next(compress(count(), map(ne, a, b)))  # the first that differs
        k, pos = k + d, pos + d
        rid = pre_ids[pos]
        if len(skips) == 8 or rid in scheduled:  # not simply left out: spelled out
            break
        skips.append(rid)
        before.append(k)
        pos += 1
    while skips and before[-1] == k:  # none of the implicit decodes after it
        skips.pop()
        before.pop()
    return k, skips


def _set_aside(outs: Any, rids: list[str]) -> tuple[list[Any], list[Any]]:
    """`outs` without the outputs of requests `rids`, and those (in their order)."""
    outs = list(outs)
    ids = list(map(_RID, outs))
    at = sorted(ids.index(r) for r in rids if r in ids)
    aside = [outs[i] for i in at]
    for i in reversed(at):
        del outs[i]
    return outs, aside


def _flat_outputs(outputs: Any) -> Any:
    """vLLM's outputs of one update, all clients', in order (a client's come in the
    batch's scheduling order)."""
    if len(outputs) == 1:
        (only,) = outputs.values()
        return only.outputs
    return [o for eo in outputs.values() for o in eo.outputs]


def _one_token_each(outs: Any) -> tuple[int, ...] | None:
    """The tokens of outputs of requests each scheduled one token and no drafts, so each
    sampled at most one: the first of each output's (a list comprehension reads vLLM's
    outputs three times as fast as chaining their lists). None if one has none."""
    try:
        return tuple([o.new_token_ids[0] for o in outs])
    except IndexError:
        return None


def _decode_entries(refs: Iterable[int], requests: Iterable[Any]) -> tuple[Scheduled, ...]:
    """DECODE entries of one token each for vLLM's `requests` (after schedule(), which
    counted the token as computed already)."""
    decode = Kind.DECODE
    return tuple(
        Scheduled(ref, 1, decode, r.num_computed_tokens - 1) for ref, r in zip(refs, requests)
    )


def _same_order(a: Any, b: Any) -> bool:
    """Whether two SchedulerOutputs scheduled the same requests in the same order; when
    neither admitted a request, by one C-level comparison of their running requests."""
    if not a.scheduled_new_reqs and not b.scheduled_new_reqs:
        return bool(a.scheduled_cached_reqs.req_ids == b.scheduled_cached_reqs.req_ids)
    return list(a.num_scheduled_tokens) == list(b.num_scheduled_tokens)


class _EmptyOutput:
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens = 0
