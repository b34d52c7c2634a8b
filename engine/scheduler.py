"""The scheduler: vLLM V1's algorithm, decision for decision.

One `schedule()` per step gives each request a number of tokens to compute. Prefill,
chunked prefill, decode and speculative decode are the same thing here: the gap between
`num_tokens_with_spec` and `num_computed_tokens`. Running requests go first, in admission
order; waiting requests get what is left, unless this step preempted someone.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from operator import attrgetter

from engine.config import EngineConfig
from engine.kv.block_pool import KVBlock
from engine.kv.manager import NO_BLOCKS, KVCacheManager, cdiv
from engine.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from engine.queues import make_queue
from engine.records import (
    Admission,
    Arrival,
    Entries,
    Finish,
    Kind,
    KVEvents,
    Preemption,
    QueueStop,
    Reason,
    Scheduled,
    Shortfall,
    SpecAccepted,
    SpecProposed,
)
from engine.request import Request, Status
from engine.rules import (
    admission_failure,
    cut_short,
    entry_kind,
    long_prefill_cap,
    one_each,
    queue_stop,
    running_kv_stop,
    waiting_limit,
)

_REF = attrgetter("ref")
# Enum members read in the step's loops, bound once: on Python 3.11 `Status.RUNNING` goes
# through EnumType.__getattr__'s hook, about 0.1 µs a read (a module global: under 0.01),
# and the update's running filter read it once per running request.
_RUNNING, _PREEMPTED = Status.RUNNING, Status.PREEMPTED
_STOPPED, _CAPPED = Status.FINISHED_STOPPED, Status.FINISHED_LENGTH_CAPPED
_DECODE = Kind.DECODE
# The new block ids of a request that got none (most, most steps): one shared list, read
# only, rather than a new one per request per step.
_NO_BLOCK_IDS: list[int] = []
PLACEHOLDER = -1  # a padding draft: never a token, so always rejected


# Decisions, Outcome and Ending are built once a step and never changed afterwards, but
# not frozen: a frozen dataclass sets each field through object.__setattr__, which made
# building these three the larger part of a step's fixed cost (about 1 µs a field).
@dataclass(slots=True)
class Decisions:
    """What schedule() decided, for the step record: none of it changes afterwards."""

    step: int  # step index, from 0
    arrivals: tuple[Arrival, ...]  # added since the last step
    scheduled: Entries  # in scheduling order: running first, then admitted
    admissions: tuple[Admission, ...]  # entered running, in order
    preemptions: tuple[Preemption, ...]  # in the order they happened
    shortfalls: tuple[Shortfall, ...]  # requests cut short, each with its reason
    running_stop: QueueStop | None  # why the running pass left requests unscheduled
    waiting_stop: QueueStop | None  # why the waiting pass left requests in waiting
    num_free_blocks: int  # free blocks right after schedule()


@dataclass(slots=True)
class Outcome:
    """What update_from_output() made of the runner's output, for the step record."""

    finishes: tuple[Finish, ...]  # every finish since the last step, aborts and errors included
    finished: tuple[Request, ...]  # the requests of `finishes`, in the same order
    sample_counts: tuple[int, ...] | None  # tokens per scheduled entry; None: one each
    sampled_tokens: tuple[int, ...]  # every sampled token, in entry order
    spec_accepted: tuple[SpecAccepted, ...]  # drafts accepted per speculative request
    updated: list[Request]  # requests that got tokens or finished in the update
    spec_proposed: tuple[SpecProposed, ...] = ()  # drafts proposed per request, for next time


@dataclass(slots=True)
class Ending:
    """The end of a step: its KV events and where the queues and the pool stand."""

    kv_events: KVEvents  # every block movement of the step, in order
    num_free_blocks: int  # free blocks now
    running: list[Request]  # the running queue, in order
    waiting: list[Request]  # the waiting queue, in order


class _Pass:
    """Scratch state of one schedule() call. A plain class: a dataclass's default
    factories cost a call each, every step."""

    __slots__ = (
        "budget",
        "threshold",
        "cursor",
        "num_scheduled",
        "running_reqs",
        "computed_before",
        "explicit",
        "new_blocks",
        "block_at",
        "spec_tokens",
        "admitted",
        "admissions",
        "preempted",
        "preemptions",
        "shortfalls",
        "running_stop",
        "waiting_stop",
        "prefill_scheduled",
    )

    def __init__(self, budget: int, threshold: int) -> None:
        self.budget = budget  # tokens left this step
        self.threshold = threshold  # long-prefill cap in force this step (0 = off)
        self.cursor = 0  # index in running of the request being scheduled
        self.num_scheduled: dict[str, int] = {}
        self.running_reqs: list[Request] = []  # scheduled from running
        self.computed_before: list[int] = []  # theirs, before this step
        # entry index -> record, for each entry that is not a one-token decode (Entries)
        self.explicit: dict[int, Scheduled] = {}
        self.new_blocks: dict[str, list[KVBlock]] = {}  # running requests that got blocks
        # Their entries' indices, in the same order; None once a preemption took a
        # scheduled request back (the indices after it moved).
        self.block_at: list[int] | None = []
        self.spec_tokens: dict[str, list[int]] = {}
        self.admitted: list[Request] = []
        self.admissions: list[Admission] = []
        self.preempted: list[Request] = []
        self.preemptions: list[Preemption] = []
        self.shortfalls: list[Shortfall] = []
        self.running_stop: QueueStop | None = None
        self.waiting_stop: QueueStop | None = None
        self.prefill_scheduled = False  # the running pass scheduled a partial prefill chunk


def _reaches_max_tokens_in_flight(req: Request) -> bool:
    """Async: whether the samples in flight already take `req` to max_tokens, so that
    another step would be wasted (vLLM's AsyncScheduler skips it, and so do we)."""
    return (
        req.num_computed_tokens + 2 - req.num_output_placeholders
        >= req.num_prompt_tokens + req.sampling_params.max_tokens
    )


class Scheduler:
    """Continuous batching with chunked prefill, a token budget, KV admission control,
    preemption by recompute and prefix caching (docs/contracts.md S1-S12, K1-K8)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.policy = config.policy
        self.max_model_len = config.max_model_len
        self.max_num_running = config.max_num_active_seqs or config.max_num_seqs
        self.num_spec_tokens = config.num_speculative_tokens
        # KV slots past the scheduled tokens: a drafter that writes KV ahead (a draft model,
        # the simulated drafter) needs k of them; prompt lookup reads only known tokens, so
        # vLLM reserves none for it.
        self.num_lookahead_tokens = 0 if config.speculative_config else self.num_spec_tokens
        self.async_scheduling = config.async_scheduling
        self.kv = KVCacheManager(
            config.block_size,
            config.num_blocks,
            config.max_model_len,
            config.enable_prefix_caching,
            config.watermark_blocks,
        )
        self.kv.num_lookahead_tokens = self.num_lookahead_tokens
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = make_queue(config.policy)
        self.step_index = 0
        self.next_ref = 0  # the ref the next request gets
        self.finished: dict[str, Request] = {}  # every finish, until the caller takes it
        self._finished_ids: set[str] = set()  # for the next SchedulerOutput
        self._arrivals: list[Arrival] = []
        self._finishes: list[Finish] = []  # since the last step record
        self._finished_reqs: list[Request] = []  # the requests of _finishes

    # -- requests in and out --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never run finishes at once with FINISHED_ERROR."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.ref = self.next_ref
        self.next_ref += 1
        request.arrival_step = self.step_index
        self._arrivals.append(
            Arrival(
                request.ref,
                request.request_id,
                request.num_prompt_tokens,
                request.priority,
                request.arrival_time,
                request.eos_token_id,
                request.sampling_params,
                tuple(request.prompt_token_ids),
                tuple(request.block_hashes),
                request.tenant,
            )
        )
        problem = self._never_fits(request)
        if problem:
            self._record_finish(request, Status.FINISHED_ERROR, problem)
            return
        # The length at which check_stop's length caps may end it; with stop tokens every
        # token needs the full check (0).
        params = request.sampling_params
        if not params.stop_token_ids:
            request.stop_len = min(
                self.max_model_len, request.num_prompt_tokens + params.max_tokens
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _never_fits(self, request: Request) -> str:
        n = request.num_tokens
        if n == 0:
            return "empty prompt"
        if n >= self.max_model_len:
            return f"prompt of {n} tokens: must be shorter than max_model_len={self.max_model_len}"
        if not self._can_ever_fit(request):
            slots = min(n + self.num_lookahead_tokens, self.max_model_len)
            return (
                f"{n} tokens need {cdiv(slots, self.config.block_size)} KV blocks; "
                f"the pool has {self.config.usable_blocks}"
            )
        return ""

    def _can_ever_fit(self, request: Request) -> bool:
        """Whether the request could be computed with the whole pool to itself. If not,
        vLLM would retry it forever (or livelock preempting itself); we end it instead."""
        slots = min(request.num_tokens + self.num_lookahead_tokens, self.max_model_len)
        return self.kv.can_ever_fit(slots)

    def abort(self, request_id: str, message: str = "") -> bool:
        """Finish a waiting or running request with FINISHED_ABORTED; False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == _RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, Status.FINISHED_ABORTED, message)
        return True

    def _finish(self, request: Request, status: Status, message: str = "") -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self._record_finish(request, status, message)

    def _record_finish(self, request: Request, status: Status, message: str) -> None:
        """The one place a request finishes: its status, its record, and the list the
        caller takes finished requests from."""
        request.status = status
        request.finish_message = message
        self._finishes.append(Finish(request.ref, status, message))
        self._finished_reqs.append(request)
        self.finished[request.request_id] = request

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call, however they finished."""
        done = list(self.finished.values())
        self.finished.clear()
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_finishes(self) -> tuple[tuple[Finish, ...], tuple[Request, ...]]:
        """The finishes no update has reported yet, and their requests (async: a step
        with no update reports the aborts before it itself)."""
        done = tuple(self._finishes), tuple(self._finished_reqs)
        self._finishes = []
        self._finished_reqs = []
        return done

    @property
    def has_unreported_finishes(self) -> bool:
        """Whether finished requests are still to be announced to the runner (vLLM's
        has_finished_requests): their step must be scheduled even with nothing to run."""
        return bool(self._finished_ids)

    @property
    def has_unreported(self) -> bool:
        """Whether something happened since the last report (arrivals, aborts and their KV
        events) that the next step's report will carry."""
        return bool(self._arrivals or self._finishes or self.kv.events)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, Decisions]:
        """Decide this step. Returns the runner's input and the decisions to report."""
        cfg = self.config
        threshold = long_prefill_cap(
            cfg.long_prefill_token_threshold,
            cfg.long_prefill_token_threshold_adaptive,
            cfg.max_num_batched_tokens,
            len(self.running) + len(self.waiting),
        )
        p = _Pass(budget=cfg.max_num_batched_tokens, threshold=threshold)
        self._schedule_running(p)
        if p.preempted:
            if self.waiting:
                p.waiting_stop = queue_stop(Reason.PREEMPTION)
        else:
            self._schedule_waiting(p)
        return self._make_output(p)

    def _schedule_running(self, p: _Pass) -> None:
        # The hottest loop of the engine: it runs for every running request every step, so
        # it keeps state in locals (the cursor and the budget go back to `p` around a
        # preemption, which moves them), skips the KV manager for a request whose table
        # has room (kv_quiet), and writes each entry and advances its request as it goes:
        # a request scheduled here is taken back only by a preemption, which undoes it.
        running = self.running
        kv = self.kv
        threshold = p.threshold
        last_position = self.max_model_len - 1
        lookahead = self.num_lookahead_tokens
        is_async = self.async_scheduling
        num_scheduled = p.num_scheduled
        new_blocks = p.new_blocks
        # (Appending to it after a preemption set p.block_at to None is harmless.)
        block_at = p.block_at if p.block_at is not None else []
        running_reqs = p.running_reqs
        before = p.computed_before.append
        decode = _DECODE
        cursor = p.cursor
        budget = p.budget
        while cursor < len(running):
            if budget <= 0:
                p.running_stop = queue_stop(Reason.TOKEN_BUDGET)
                break
            req = running[cursor]
            computed = req.num_computed_tokens
            known = len(req.all_token_ids)
            if (
                known - computed == 1
                and computed < last_position
                and not req.spec_token_ids
                and not req.prefill_chunk
                and req.output_token_ids
                and not (is_async and req.num_output_placeholders)
            ):
                # A decode (most requests, most steps): one token, no cap can cut it, a
                # DECODE entry. What the general path below does for it, and no more.
                if computed < req.kv_quiet:
                    # Steady: its table has room and it fills no block.
                    cursor += 1
                    num_scheduled[req.request_id] = 1
                    budget -= 1
                    running_reqs.append(req)
                    before(computed)
                    req.num_computed_tokens = known  # its entry: implicit (Entries)
                    continue
                # It fills a block or needs a new one (one in block_size of them a step).
                got = kv.allocate_running(req, 1, lookahead)
                if got is not None:
                    cursor += 1
                    rid = req.request_id
                    num_scheduled[rid] = 1
                    if got:
                        new_blocks[rid] = got
                        block_at.append(len(running_reqs))
                    budget -= 1
                    running_reqs.append(req)
                    before(computed)
                    req.num_computed_tokens = known
                    continue
                # No room: the general path preempts (allocate_running changed nothing).
            n = wanted = known + len(req.spec_token_ids) - computed
            placeholders = 0
            if is_async and req.num_output_placeholders:
                if _reaches_max_tokens_in_flight(req):
                    cursor += 1  # its last token is in flight: nothing more to schedule
                    continue
                placeholders = req.num_output_placeholders
                n = wanted = wanted + placeholders
            if n > 1 or computed >= last_position:
                n, reason = cut_short(n, threshold, budget, last_position - computed)
            else:  # a decode: no cap cuts one token (budget > 0 here, a threshold is >= 1)
                reason = None
            if n <= 0:
                p.shortfalls.append(Shortfall(req.ref, wanted, 0, Reason.MAX_MODEL_LEN))
                cursor += 1
                continue
            if computed + n <= req.kv_quiet:
                blocks = NO_BLOCKS  # room in its table and no block filled: nothing to do
            else:
                got = kv.allocate_running(req, n, lookahead)
                if got is None:
                    p.cursor, p.budget = cursor, budget
                    got = self._preempt_until_fits(req, n, p)
                    cursor, budget = p.cursor, p.budget
                    if got is None:
                        if self.policy == "priority":
                            continue  # it preempted itself; the cursor points at the next
                        p.running_stop = running_kv_stop()
                        break
                blocks = got
            cursor += 1
            rid = req.request_id
            if req.prefill_chunk:  # vLLM's is_prefill_chunk: still prefilling from last step
                p.prefill_scheduled = True
            if reason is not None:
                p.shortfalls.append(Shortfall(req.ref, wanted, n, reason))
            num_scheduled[rid] = n
            if blocks:
                new_blocks[rid] = blocks
                block_at.append(len(running_reqs))
            budget -= n
            running_reqs.append(req)
            before(computed)
            num_spec = 0
            if req.spec_token_ids:
                num_spec = n + computed - known
                if num_spec > 0:
                    p.spec_tokens[rid] = drafts = req.spec_token_ids[:num_spec]
                    num_spec = len(drafts)
                else:
                    num_spec = 0
                req.spec_token_ids = []
            # The entry and its request's progress (what _advance does for admitted ones).
            chunk = computed + n < known + placeholders
            if n != 1 or chunk or num_spec or not req.output_token_ids:
                kind = entry_kind(n, chunk, req.output_token_ids, num_spec)
                if kind != decode:  # a decode's entry is implicit (Entries)
                    p.explicit[len(running_reqs) - 1] = Scheduled(
                        req.ref, n, kind, computed, num_spec
                    )
            req.num_computed_tokens = computed + n
            req.prefill_chunk = chunk and not num_spec  # entry_kind's CHUNK
        p.cursor, p.budget = cursor, budget

    def _preempt_until_fits(self, req: Request, n: int, p: _Pass) -> list[KVBlock] | None:
        """Preempt victims until `req`'s slots fit, or `req` itself is the victim (S5).
        Returns the new blocks, or None."""
        while True:
            victim = self._remove_victim(p)
            given_back = p.num_scheduled.pop(victim.request_id, 0)
            if given_back:
                # PRIORITY can pick a request already scheduled this step: take it back out,
                # entry, progress and all.
                p.budget += given_back
                index = p.running_reqs.index(victim)
                del p.running_reqs[index]
                del p.computed_before[index]
                if p.explicit:  # the entries after it move up one
                    p.explicit = {i - (i > index): e for i, e in p.explicit.items() if i != index}
                victim.num_computed_tokens -= given_back
                p.new_blocks.pop(victim.request_id, None)
                p.block_at = None
                p.spec_tokens.pop(victim.request_id, None)
                p.shortfalls[:] = [s for s in p.shortfalls if s.ref != victim.ref]
            p.preemptions.append(
                Preemption(victim.ref, req.ref, victim.num_computed_tokens, given_back)
            )
            self._preempt(victim)
            p.preempted.append(victim)
            if victim is req:
                return None
            blocks = self.kv.allocate_running(req, n, self.num_lookahead_tokens)
            if blocks is not None:
                return blocks

    def _remove_victim(self, p: _Pass) -> Request:
        """Take the preemption victim out of `running` (S5), keeping the cursor on the
        request being scheduled."""
        if self.policy != "priority":
            return self.running.pop()
        # max() keeps the first of equals: ties go to the earliest in running.
        victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        index = self.running.index(victim)
        del self.running[index]
        if index < p.cursor:
            p.cursor -= 1
        return victim

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free the blocks, forget the computed tokens (S6)."""
        self.kv.free(req)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        self.waiting.prepend(req)

    def _schedule_waiting(self, p: _Pass) -> None:
        waiting = self.waiting
        skipped: list[Request] = []
        while waiting:
            limit = waiting_limit(p.budget, len(self.running), self.max_num_running)
            if limit is not None:
                p.waiting_stop = queue_stop(limit)
                break
            req = waiting.peek()
            if req.num_stale_output_tokens:
                # Async: its pre-preemption samples are still in flight; resuming now
                # would compute positions they fill. vLLM passes over it this step.
                skipped.append(waiting.pop())
                continue
            if not self._admit(req, p):
                break
        for req in reversed(skipped):
            waiting.prepend(req)

    def _admit(self, req: Request, p: _Pass) -> bool:
        """Try to move the head of `waiting` into running. False ends the waiting pass."""
        if not self._can_ever_fit(req):
            self.waiting.pop()
            self._finish(
                req,
                Status.FINISHED_ERROR,
                f"{req.num_tokens} tokens can never fit in {self.config.usable_blocks} KV blocks",
            )
            return True
        hits, num_hits = (
            self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
        )
        wanted = req.num_tokens - num_hits
        pad = self._decode_padding(wanted, num_hits, p)
        if pad and 1 + pad > p.budget:
            p.waiting_stop = queue_stop(Reason.TOKEN_BUDGET)
            return False
        if 0 < p.threshold < wanted + pad:
            pad = 0  # vLLM asserts that a padded entry keeps every row; never cut one
        # A prompt is shorter than max_model_len (add_request), so only the cap and the
        # budget can cut it; a padded entry fits both (checked above).
        n, reason = cut_short(wanted + pad, p.threshold, p.budget, wanted + pad)
        if reason is Reason.TOKEN_BUDGET and not self.config.enable_chunked_prefill:
            p.waiting_stop = queue_stop(Reason.NO_CHUNKING)
            return False
        blocks = self.kv.allocate_slots(
            req,
            n,
            num_hits,
            hits,
            self.num_lookahead_tokens,
            full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
            has_scheduled_reqs=bool(self.running),
        )
        if blocks is None:
            head = self._admission_failure(req, n, num_hits, hits)
            p.waiting_stop = queue_stop(head)
            return False
        self.waiting.pop()
        self.running.append(req)
        resumed = req.status == _PREEMPTED
        req.status = _RUNNING
        req.num_computed_tokens = num_hits
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hits
        if req.first_scheduled_step < 0:
            req.first_scheduled_step = self.step_index
        p.num_scheduled[req.request_id] = n
        p.budget -= n
        p.admitted.append(req)
        p.admissions.append(Admission(req.ref, num_hits, resumed))
        if pad:
            p.spec_tokens[req.request_id] = [PLACEHOLDER] * pad
        if reason is not None:
            p.shortfalls.append(Shortfall(req.ref, wanted, n, reason))
        return True

    def _decode_padding(self, wanted: int, num_hits: int, p: _Pass) -> int:
        """Placeholder drafts for an admitted request with one token to compute (a 1-token
        prompt, a resume whose tokens are all cached but the last): vLLM pads it to the
        step's uniform 1 + k query rows (for CUDA graphs) unless a partial prefill is in
        the step, and the placeholders are then rejected like wrong drafts."""
        k = self.num_spec_tokens
        if (
            k
            and wanted == 1
            and not p.prefill_scheduled
            and (p.running_reqs or num_hits > 0)
            and num_hits + 1 + k + 1 <= self.max_model_len
            # vLLM would retry a padding that can never fit forever; we admit it unpadded.
            and self.kv.can_ever_fit(num_hits + 1 + k + self.num_lookahead_tokens)
        ):
            return k
        return 0

    def _admission_failure(
        self, req: Request, n: int, num_hits: int, hits: list[KVBlock]
    ) -> Reason:
        """Which of the three admission tests failed (K3, K6, S8)."""
        max_len = self.max_model_len
        return admission_failure(
            lambda slots: self.kv.blocks_needed(req, slots, hits),
            self.kv.num_free_blocks,
            min(num_hits + n + self.num_lookahead_tokens, max_len),
            min(req.num_tokens, max_len) if self.config.scheduler_reserve_full_isl else None,
        )

    # -- output ------------------------------------------------------------------------------

    def _make_output(self, p: _Pass) -> tuple[SchedulerOutput, Decisions]:
        step = self.step_index
        new_reqs = [self._new_request_data(r, p) for r in p.admitted]
        running_reqs = p.running_reqs
        k = len(running_reqs)
        # num_scheduled holds the running requests first, in scheduling order; new_blocks
        # only those that got blocks (a few a step), so every other entry shares one list.
        ids = list(islice(p.num_scheduled, k))
        new_block_ids = [_NO_BLOCK_IDS] * k
        if p.new_blocks:
            # The entries' indices as the running pass kept them (a dict of all k ids
            # to find a few cost more than the rest of this method).
            at = p.block_at
            if at is None:
                index = dict(zip(ids, range(k)))
                at = [index[rid] for rid in p.new_blocks]
            for i, blocks in zip(at, p.new_blocks.values()):
                new_block_ids[i] = [b.block_id for b in blocks]
        # computed_before is shared with the step's entries (_advance): both read only.
        cached = CachedRequestData(ids, new_block_ids, p.computed_before)
        scheduled = self._advance(p)
        if self.async_scheduling:
            self._count_in_flight(p)
        out = SchedulerOutput(
            step=step,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=p.num_scheduled,
            total_num_scheduled_tokens=sum(p.num_scheduled.values()),
            scheduled_spec_decode_tokens=p.spec_tokens,
            finished_req_ids=self._finished_ids,
            preempted_req_ids={r.request_id for r in p.preempted},
        )
        self._finished_ids = set()
        decisions = Decisions(
            step,
            tuple(self._arrivals),
            scheduled,
            tuple(p.admissions),
            tuple(p.preemptions),
            tuple(p.shortfalls),
            p.running_stop,
            p.waiting_stop,
            self.kv.num_free_blocks,
        )
        self._arrivals = []
        return out, decisions

    def _new_request_data(self, req: Request, p: _Pass) -> NewRequestData:
        return NewRequestData(
            req.request_id,
            list(req.all_token_ids),
            req.num_prompt_tokens,
            req.sampling_params,
            self.kv.get_block_ids(req.request_id),
            req.num_computed_tokens,
        )

    def _advance(self, p: _Pass) -> Entries:
        """Move every admitted request's num_computed_tokens forward and label its tokens,
        after the running requests' entries (_schedule_running did theirs); the step's
        entries."""
        if not p.admitted:
            return Entries(p.running_reqs, p.computed_before, p.explicit)
        owners = p.running_reqs + p.admitted
        befores = p.computed_before[:]
        explicit = p.explicit
        spec = p.spec_tokens
        decode = _DECODE
        # num_scheduled's order: the running requests scheduled, then the admitted ones.
        k = len(p.running_reqs)
        for i, (req, n) in enumerate(zip(p.admitted, islice(p.num_scheduled.values(), k, None))):
            before = req.num_computed_tokens
            befores.append(before)
            num_spec = len(spec[req.request_id]) if spec and req.request_id in spec else 0
            chunk = before + n < len(req.all_token_ids) + req.num_output_placeholders
            if n != 1 or chunk or num_spec or not req.output_token_ids:
                kind = entry_kind(n, chunk, req.output_token_ids, num_spec)
                if kind != decode:  # a decode's entry is implicit (Entries)
                    explicit[k + i] = Scheduled(req.ref, n, kind, before, num_spec)
            req.num_computed_tokens = before + n
            req.prefill_chunk = chunk and not num_spec  # entry_kind's CHUNK
        return Entries(owners, befores, explicit)

    def _count_in_flight(self, p: _Pass) -> None:
        """Async: the step's tokens are in flight, and every request that samples counts on
        its sample (a placeholder) when the next step is scheduled."""
        requests = self.requests
        for rid, n in p.num_scheduled.items():
            req = requests[rid]
            req.num_in_flight_tokens += n
            if req.num_computed_tokens >= len(req.all_token_ids) + req.num_output_placeholders:
                req.num_output_placeholders += 1

    # -- update -------------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> Outcome:
        """Apply what the runner sampled: append tokens, roll back rejected drafts, finish
        requests that stopped. With async scheduling `out` is an earlier step's batch."""
        if result.logprobs:
            # Taken before the update, which forgets the requests that finish in it.
            owners = [(self.requests.get(rid), lps) for rid, lps in result.logprobs.items()]
            outcome = self._update(out, result)
            _attach_logprobs(owners)
            return outcome
        return self._update(out, result)

    def _update(self, out: SchedulerOutput, result: ModelRunnerOutput) -> Outcome:
        if self.async_scheduling:
            return self._update_async(out, result)
        touched: list[Request] = []
        finished_any = False
        counts: list[int] = []  # tokens per entry of `result`, in its order
        flat: list[int] = []
        accepted_drafts: list[SpecAccepted] = []
        spec = out.scheduled_spec_decode_tokens
        drafts = result.draft_token_ids
        requests = self.requests
        step = self.step_index
        caching = self.config.enable_prefix_caching
        proposed: list[SpecProposed] = []
        if not spec and not drafts:
            finished_any = self._update_plain(result, touched, counts, flat)
        else:
            for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
                req = requests.get(rid) if tokens else None
                if req is None:  # mid-prefill, or aborted while the runner worked
                    counts.append(0)
                    continue
                if spec and rid in spec:
                    accepted = len(tokens) - 1
                    accepted_drafts.append(SpecAccepted(req.ref, accepted))
                    req.num_computed_tokens -= len(spec[rid]) - accepted
                if req.first_token_step < 0:
                    req.first_token_step = step
                if len(tokens) == 1:  # the common case: no loop
                    tok = tokens[0]
                    req.append_output_token_ids(tok)
                    stopped = self.check_stop(req, tok)
                else:
                    stopped = self._append(req, tokens)
                flat += tokens
                counts.append(len(tokens))
                touched.append(req)
                if spec and rid in spec and caching:
                    # Accepted drafts may have filled blocks: hash them now, as vLLM does, even
                    # for a request that just stopped (its full blocks then free to the tail).
                    self.kv.cache_blocks(req, req.num_computed_tokens)
                if stopped:
                    finished_any = True
                    self._finish(req, req.status)
                elif drafts:
                    req.spec_token_ids = proposal = drafts.get(rid, [])
                    if proposal:
                        proposed.append(SpecProposed(req.ref, len(proposal)))
        if finished_any:
            self.running = [r for r in self.running if r.status == _RUNNING]
        outcome = Outcome(
            tuple(self._finishes),
            tuple(self._finished_reqs),
            self._entry_counts(out, result, counts, len(flat)),
            tuple(flat),
            tuple(accepted_drafts),
            touched,
            tuple(proposed),
        )
        self._finishes = []
        self._finished_reqs = []
        return outcome

    def _update_plain(
        self,
        result: ModelRunnerOutput,
        touched: list[Request],
        counts: list[int],
        flat: list[int],
    ) -> bool:
        """update_from_output's loop for a step without drafts (every step without
        speculative decoding): the same work, with the one-token sample (a decode, or a
        prefill's first token) inlined, as it runs for every running request every step.
        Returns whether a request finished."""
        get = self.requests.get
        step = self.step_index
        count = counts.append
        put = flat.append
        touch = touched.append
        finished_any = False
        for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
            req = get(rid) if tokens else None
            if req is None:  # mid-prefill, or aborted while the runner worked
                count(0)
                continue
            if req.first_token_step < 0:
                req.first_token_step = step
            if len(tokens) == 1:  # append_output_token_ids and check_stop, inlined
                tok = tokens[0]
                req.output_token_ids.append(tok)
                all_ids = req.all_token_ids
                all_ids.append(tok)
                num = len(all_ids)
                if num >= req.hash_due and req.block_hasher is not None:
                    req.block_hasher(req)
                put(tok)
                count(1)
                touch(req)
                # Only EOS, a stop token (stop_len is then 0) or a length cap can stop it.
                if (tok == req.eos_token_id or num >= req.stop_len) and self.check_stop(req, tok):
                    finished_any = True
                    self._finish(req, req.status)
                continue
            stopped = self._append(req, tokens)
            flat += tokens
            count(len(tokens))
            touch(req)
            if stopped:
                finished_any = True
                self._finish(req, req.status)
        return finished_any

    @staticmethod
    def _entry_counts(
        out: SchedulerOutput, result: ModelRunnerOutput, counts: list[int], total: int
    ) -> tuple[int, ...] | None:
        """Sampled tokens per scheduled entry, in scheduling order; None when every entry
        sampled exactly one (the steady decode step)."""
        entries = out.num_scheduled_tokens
        if result.req_ids != list(entries):  # the runner reordered, or ran nothing
            by_id = dict(zip(result.req_ids, counts))
            counts = [by_id.get(rid, 0) for rid in entries]
        if one_each(counts, total, len(counts)):
            return None
        return tuple(counts)

    def _update_async(self, out: SchedulerOutput, result: ModelRunnerOutput) -> Outcome:
        """update_from_output for an older step's batch (async scheduling): settle the
        in-flight counts, deliver samples (also to requests preempted since, whose
        stale samples still count but move nothing else), cache newly known blocks."""
        touched: list[Request] = []
        counts: list[int] = []
        flat: list[int] = []
        finished_running = False
        requests = self.requests
        step = self.step_index
        for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
            req = requests.get(rid)
            if req is None:
                counts.append(0)
                continue  # finished while the runner worked
            n = out.num_scheduled_tokens[rid]
            req.num_in_flight_tokens -= n
            stale = req.num_stale_output_tokens > 0
            if stale:
                req.num_stale_output_tokens -= n
            if not tokens:
                counts.append(0)
                continue
            was_running = req.status == _RUNNING
            had_placeholders = req.num_output_placeholders > 0
            num_new = len(tokens)
            if req.first_token_step < 0:
                req.first_token_step = step
            stopped = self._append(req, tokens)
            if not stale and had_placeholders:
                req.num_output_placeholders -= num_new
            flat += tokens
            counts.append(len(tokens))
            touched.append(req)
            if not stale and was_running and had_placeholders:
                # Before a finish frees them: a block hashed now goes to the free queue's
                # tail (reusable by a prefix hit) rather than its head.
                self.kv.cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
            if stopped:
                if was_running:
                    finished_running = True
                else:
                    self.waiting.remove(req)
                self._finish(req, req.status)
        if finished_running:
            self.running = [r for r in self.running if r.status == _RUNNING]
        outcome = Outcome(
            tuple(self._finishes),
            tuple(self._finished_reqs),
            self._entry_counts(out, result, counts, len(flat)),
            tuple(flat),
            (),
            touched,
        )
        self._finishes = []
        self._finished_reqs = []
        return outcome

    def _append(self, req: Request, tokens: list[int]) -> bool:
        """Append sampled tokens, stopping at the first that ends the request (S10)."""
        for k, tok in enumerate(tokens, 1):
            req.append_output_token_ids(tok)
            if self.check_stop(req, tok):
                if k < len(tokens):
                    req.num_computed_tokens -= len(tokens) - k
                    del tokens[k:]
                return True
        return False

    def check_stop(self, req: Request, tok: int) -> bool:
        """Whether `tok`, just appended, ends the request; if so its status says how."""
        params = req.sampling_params
        if tok == req.eos_token_id and not params.ignore_eos:
            req.status = _STOPPED
        elif params.stop_token_ids and tok in params.stop_token_ids:
            req.status = _STOPPED
            req.stop_reason = tok
        elif (
            len(req.all_token_ids) >= self.max_model_len
            or len(req.output_token_ids) >= params.max_tokens
        ):
            req.status = _CAPPED
        else:
            return False
        return True

    def end_step(self) -> Ending:
        """Close the step: its KV events, and the queues and free blocks at its end."""
        ending = Ending(
            self.kv.take_events().freeze(),
            self.kv.num_free_blocks,
            list(self.running),
            list(self.waiting),
        )
        self.step_index += 1
        return ending


def _attach_logprobs(owners: list[tuple[Request | None, list[TokenLogprobs]]]) -> None:
    """Each request's logprobs for the tokens the update kept (a stop may have cut some
    of what the runner sampled): the list stays one entry per output token."""
    for req, lps in owners:
        if req is None:
            continue
        if req.logprobs is None:
            req.logprobs = []
        missing = req.num_output_tokens - len(req.logprobs)
        if missing > 0:
            req.logprobs.extend(lps[:missing])
