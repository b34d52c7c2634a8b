"""The scheduler: vLLM V1's algorithm, decision for decision.

One `schedule()` per step gives each request a number of tokens to compute. Prefill,
chunked prefill, decode and speculative decode are the same thing here: the gap between
`num_tokens_with_spec` and `num_computed_tokens`. Running requests go first, in admission
order; waiting requests get what is left, unless this step preempted someone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from engine.config import EngineConfig
from engine.kv.block_pool import KVBlock
from engine.kv.manager import KVCacheManager, cdiv
from engine.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from engine.queues import make_queue
from engine.records import (
    Admission,
    Arrival,
    Finish,
    Kind,
    KVEvents,
    Preemption,
    QueueStop,
    Reason,
    Scheduled,
    Shortfall,
    SpecAccepted,
)
from engine.request import Request, RequestStatus

_REF = attrgetter("ref")


@dataclass(frozen=True, slots=True)
class Decisions:
    """What schedule() decided, for the step record: none of it changes afterwards."""

    step: int  # step index, from 0
    arrivals: tuple[Arrival, ...]  # added since the last step
    scheduled: tuple[Scheduled, ...]  # in scheduling order: running first, then admitted
    admissions: tuple[Admission, ...]  # entered running, in order
    preemptions: tuple[Preemption, ...]  # in the order they happened
    shortfalls: tuple[Shortfall, ...]  # requests cut short, each with its reason
    running_stop: QueueStop | None  # why the running pass left requests unscheduled
    waiting_stop: QueueStop | None  # why the waiting pass left requests in waiting
    num_free_blocks: int  # free blocks right after schedule()


@dataclass(frozen=True, slots=True)
class Outcome:
    """What update_from_output() made of the runner's output, for the step record."""

    finishes: tuple[Finish, ...]  # every finish since the last step, aborts and errors included
    finished: tuple[Request, ...]  # the requests of `finishes`, in the same order
    sample_counts: tuple[int, ...] | None  # tokens per scheduled entry; None: one each
    sampled_tokens: tuple[int, ...]  # every sampled token, in entry order
    spec_accepted: tuple[SpecAccepted, ...]  # drafts accepted per speculative request
    updated: list[Request]  # requests that got tokens or finished in the update


@dataclass(frozen=True, slots=True)
class Ending:
    """The end of a step: its KV events and where the queues and the pool stand."""

    kv_events: KVEvents  # every block movement of the step, in order
    num_free_blocks: int  # free blocks now
    running: list[Request]  # the running queue, in order
    waiting: list[Request]  # the waiting queue, in order


@dataclass
class _Pass:
    """Scratch state of one schedule() call."""

    budget: int  # tokens left this step
    threshold: int  # long-prefill cap in force this step (0 = off)
    cursor: int = 0  # index in running of the request being scheduled
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running_reqs: list[Request] = field(default_factory=list)  # scheduled from running
    new_blocks: dict[str, list[KVBlock]] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    admitted: list[Request] = field(default_factory=list)
    admissions: list[Admission] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    shortfalls: list[Shortfall] = field(default_factory=list)
    running_stop: QueueStop | None = None
    waiting_stop: QueueStop | None = None


class Scheduler:
    """Continuous batching with chunked prefill, a token budget, KV admission control,
    preemption by recompute and prefix caching (docs/contracts.md S1-S12, K1-K8)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.policy = config.policy
        self.max_model_len = config.max_model_len
        self.max_num_running = config.max_num_active_seqs or config.max_num_seqs
        self.num_lookahead_tokens = config.num_speculative_tokens
        self.kv = KVCacheManager(
            config.block_size,
            config.num_blocks,
            config.max_model_len,
            config.enable_prefix_caching,
            config.watermark_blocks,
        )
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
            )
        )
        problem = self._never_fits(request)
        if problem:
            self._record_finish(request, RequestStatus.FINISHED_ERROR, problem)
            return
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

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request with FINISHED_ABORTED; False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def _finish(self, request: Request, status: RequestStatus, message: str = "") -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        self._record_finish(request, status, message)

    def _record_finish(self, request: Request, status: RequestStatus, message: str) -> None:
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

    @property
    def has_unreported(self) -> bool:
        """Whether something happened since the last report (arrivals, aborts and their KV
        events) that the next step's report will carry."""
        return bool(self._arrivals or self._finishes or self.kv.events)

    # -- schedule ---------------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, Decisions]:
        """Decide this step. Returns the runner's input and the decisions to report."""
        cfg = self.config
        num_eligible = len(self.running) + len(self.waiting)
        threshold = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold and cfg.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, cfg.max_num_batched_tokens // num_eligible)
        p = _Pass(budget=cfg.max_num_batched_tokens, threshold=threshold)
        self._schedule_running(p)
        if p.preempted:
            if self.waiting:
                p.waiting_stop = QueueStop(Reason.PREEMPTION, Reason.PREEMPTION)
        else:
            self._schedule_waiting(p)
        return self._make_output(p)

    def _schedule_running(self, p: _Pass) -> None:
        # The hottest loop of the engine: it runs for every running request every step, so
        # it keeps state in locals and takes the KV manager's running-request fast path.
        running = self.running
        kv = self.kv
        threshold = p.threshold
        last_position = self.max_model_len - 1
        lookahead = self.num_lookahead_tokens
        num_scheduled = p.num_scheduled
        new_blocks = p.new_blocks
        running_reqs = p.running_reqs
        while p.cursor < len(running):
            budget = p.budget
            if budget <= 0:
                p.running_stop = QueueStop(Reason.TOKEN_BUDGET, Reason.TOKEN_BUDGET)
                return
            req = running[p.cursor]
            computed = req.num_computed_tokens
            n = wanted = len(req.all_token_ids) + len(req.spec_token_ids) - computed
            reason = None
            if 0 < threshold < n:
                n, reason = threshold, Reason.LONG_PREFILL_THRESHOLD
            if n > budget:
                n, reason = budget, Reason.TOKEN_BUDGET
            if n > last_position - computed:
                n, reason = last_position - computed, Reason.MAX_MODEL_LEN
            if n <= 0:
                p.shortfalls.append(Shortfall(req.ref, wanted, 0, Reason.MAX_MODEL_LEN))
                p.cursor += 1
                continue
            blocks = kv.allocate_running(req, n, lookahead)
            if blocks is None:
                blocks = self._preempt_until_fits(req, n, p)
                if blocks is None:
                    if self.policy == "priority":
                        continue  # it preempted itself; the cursor already points at the next
                    p.running_stop = QueueStop(Reason.KV_BLOCKS, Reason.KV_BLOCKS)
                    return
            p.cursor += 1
            rid = req.request_id
            if reason is not None:
                p.shortfalls.append(Shortfall(req.ref, wanted, n, reason))
            num_scheduled[rid] = n
            new_blocks[rid] = blocks
            p.budget -= n
            running_reqs.append(req)
            if req.spec_token_ids:
                num_spec = n + computed - len(req.all_token_ids)
                if num_spec > 0:
                    p.spec_tokens[rid] = req.spec_token_ids[:num_spec]
                req.spec_token_ids = []

    def _preempt_until_fits(self, req: Request, n: int, p: _Pass) -> list[KVBlock] | None:
        """Preempt victims until `req`'s slots fit, or `req` itself is the victim (S5).
        Returns the new blocks, or None."""
        while True:
            victim = self._remove_victim(p)
            given_back = p.num_scheduled.pop(victim.request_id, 0)
            if given_back:
                # PRIORITY can pick a request already scheduled this step: take it back out.
                p.budget += given_back
                p.running_reqs.remove(victim)
                p.new_blocks.pop(victim.request_id)
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
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.waiting.prepend(req)

    def _schedule_waiting(self, p: _Pass) -> None:
        waiting = self.waiting
        while waiting:
            if p.budget <= 0:
                p.waiting_stop = QueueStop(Reason.TOKEN_BUDGET, Reason.TOKEN_BUDGET)
                return
            if len(self.running) >= self.max_num_running:
                p.waiting_stop = QueueStop(Reason.MAX_NUM_SEQS, Reason.MAX_NUM_SEQS)
                return
            req = waiting.peek()
            if not self._admit(req, p):
                return

    def _admit(self, req: Request, p: _Pass) -> bool:
        """Try to move the head of `waiting` into running. False ends the waiting pass."""
        if not self._can_ever_fit(req):
            self.waiting.pop()
            self._finish(
                req,
                RequestStatus.FINISHED_ERROR,
                f"{req.num_tokens} tokens can never fit in {self.config.usable_blocks} KV blocks",
            )
            return True
        hits, num_hits = (
            self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
        )
        wanted = req.num_tokens - num_hits
        if 0 < p.threshold < wanted:
            n, reason = p.threshold, Reason.LONG_PREFILL_THRESHOLD
        else:
            n, reason = wanted, None
        if not self.config.enable_chunked_prefill and n > p.budget:
            p.waiting_stop = QueueStop(Reason.NO_CHUNKING, Reason.HEAD_OF_LINE)
            return False
        if n > p.budget:
            n, reason = p.budget, Reason.TOKEN_BUDGET
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
            p.waiting_stop = QueueStop(head, Reason.HEAD_OF_LINE)
            return False
        self.waiting.pop()
        self.running.append(req)
        resumed = req.status == RequestStatus.PREEMPTED
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hits
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hits
        if req.first_scheduled_step < 0:
            req.first_scheduled_step = self.step_index
        p.num_scheduled[req.request_id] = n
        p.new_blocks[req.request_id] = blocks
        p.budget -= n
        p.admitted.append(req)
        p.admissions.append(Admission(req.ref, num_hits, resumed))
        if reason is not None:
            p.shortfalls.append(Shortfall(req.ref, wanted, n, reason))
        return True

    def _admission_failure(
        self, req: Request, n: int, num_hits: int, hits: list[KVBlock]
    ) -> Reason:
        """Which of the three admission tests failed (K3, K6, S8)."""
        free = self.kv.num_free_blocks
        slots = min(num_hits + n + self.num_lookahead_tokens, self.max_model_len)
        if self.kv.blocks_needed(req, slots, hits) > free:
            return Reason.KV_BLOCKS
        if self.config.scheduler_reserve_full_isl:
            full = min(req.num_tokens, self.max_model_len)
            if self.kv.blocks_needed(req, full, hits) > free:
                return Reason.FULL_PROMPT
        return Reason.WATERMARK

    # -- output ------------------------------------------------------------------------------

    def _make_output(self, p: _Pass) -> tuple[SchedulerOutput, Decisions]:
        step = self.step_index
        new_reqs = [self._new_request_data(r, p) for r in p.admitted]
        running_reqs = p.running_reqs
        new_blocks = p.new_blocks
        cached = CachedRequestData(
            [r.request_id for r in running_reqs],
            [
                [b.block_id for b in blocks] if (blocks := new_blocks[r.request_id]) else []
                for r in running_reqs
            ],
            [r.num_computed_tokens for r in running_reqs],
        )
        scheduled = self._advance(p)
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
            tuple(scheduled),
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

    def _advance(self, p: _Pass) -> list[Scheduled]:
        """Move every scheduled request's num_computed_tokens forward; label its tokens."""
        scheduled: list[Scheduled] = []
        append = scheduled.append
        requests = self.requests
        spec = p.spec_tokens
        for rid, n in p.num_scheduled.items():
            req = requests[rid]
            before = req.num_computed_tokens
            if spec and rid in spec:
                num_spec = len(spec[rid])
                kind = Kind.SPEC
            else:
                num_spec = 0
                if before + n < len(req.all_token_ids):
                    kind = Kind.CHUNK
                elif n == 1 and req.output_token_ids:
                    kind = Kind.DECODE
                else:
                    kind = Kind.PREFILL
            append(Scheduled(req.ref, n, kind, before, num_spec))
            req.num_computed_tokens = before + n
        return scheduled

    # -- update -------------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> Outcome:
        """Apply what the runner sampled: append tokens, roll back rejected drafts, finish
        requests that stopped."""
        touched: list[Request] = []
        finished_any = False
        counts: list[int] = []  # tokens per entry of `result`, in its order
        flat: list[int] = []
        accepted_drafts: list[SpecAccepted] = []
        spec = out.scheduled_spec_decode_tokens
        drafts = result.draft_token_ids
        requests = self.requests
        step = self.step_index
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
            if stopped:
                finished_any = True
                self._finish(req, req.status)
            else:
                if spec and rid in spec:
                    self.kv.cache_blocks(req, req.num_computed_tokens)
                if drafts:
                    req.spec_token_ids = drafts.get(rid, [])
        if finished_any:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        outcome = Outcome(
            tuple(self._finishes),
            tuple(self._finished_reqs),
            self._entry_counts(out, result, counts, len(flat)),
            tuple(flat),
            tuple(accepted_drafts),
            touched,
        )
        self._finishes = []
        self._finished_reqs = []
        return outcome

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
        if total == len(counts) and 0 not in counts:
            return None
        return tuple(counts)

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
            req.status = RequestStatus.FINISHED_STOPPED
        elif params.stop_token_ids and tok in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = tok
        elif (
            len(req.all_token_ids) >= self.max_model_len
            or len(req.output_token_ids) >= params.max_tokens
        ):
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
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
