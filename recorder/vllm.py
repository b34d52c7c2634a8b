"""Record a real vLLM's scheduler into a schedtop trace.

    SCHEDTOP_TRACE_DIR=/var/traces vllm serve MODEL \\
        --scheduler-cls recorder.vllm.RecordingScheduler

`RecordingScheduler` is vLLM's own scheduler (the async or the sync one, whichever vLLM
would have chosen) with taps on the calls the engine core makes. It decides nothing: it
watches each step and writes schedtop's trace format (header, steps, snapshots, footer)
through the same converter and background writer as schedtop's engine, so `replay`,
`stats`, `find`, `export`, `resim` and `diff` work on the file unchanged.

What the taps see, per step: arrivals (with vLLM's request ids, which start with the
client's id), the scheduled requests in order, admissions with prefix hits, preemptions
in the order they happened with the request that needed the room, why requests were cut
short or left waiting (the reasons schedtop's scheduler gives, derived from the same
numbers), every KV block movement with block ids (from the KV cache manager and block
pool), samples, finishes, aborts, free-block counts and the queue orders.

Block hashes in the trace are schedtop's (the same content gives the same hash in both),
so that prefix hits re-simulate. vLLM is imported lazily and is never a dependency.

Environment: SCHEDTOP_TRACE_DIR (where traces go), SCHEDTOP_REDACT_PROMPTS=1 (hashes and
lengths instead of token ids), SCHEDTOP_FLUSH_INTERVAL_S (default 1.0),
SCHEDTOP_SNAPSHOT_INTERVAL (default 256). One file per data-parallel rank. Set-ups whose
decisions schedtop's scheduler does not model are refused at start-up; requests that use
such features stop the recording with a warning (the file keeps every step before).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.events import NULL_SINK
from engine.kv.events import KVEventKind, KVEventLog
from engine.kv.hashing import ROOT_HASH, hash_block
from engine.records import (
    Admission,
    Arrival,
    Finish,
    Kind,
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
from recorder.errors import RecordingError
from recorder.paths import trace_dir
from recorder.recorder import DEFAULT_SNAPSHOT_INTERVAL, Recorder
from recorder.writer import TraceWriter

log = logging.getLogger("schedtop.recorder.vllm")

SUPPORTED_VERSIONS = ("0.33.",)  # vLLM releases whose scheduler this module has been checked on
MID_STEP_ABORT = "aborted after schedule"  # Finish.message of an abort between schedule and update

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
# What the taps call on vLLM objects: checked at start-up, so that a vLLM that moved
# them is refused with a message rather than recorded wrong.
_REQUIRED = {
    "scheduler": (
        "_preempt_request",
        "kv_cache_manager",
        "running",
        "waiting",
        "requests",
        "max_num_scheduled_tokens",
        "max_model_len",
        "policy",
    ),
    "kv_cache_manager": ("allocate_slots", "free", "cache_blocks", "block_pool", "coordinator"),
    "block_pool": ("_maybe_evict_cached_block", "get_num_free_blocks", "free_block_queue"),
}


class UnsupportedVllm(RecordingError):
    """A vLLM version or set-up that this recorder would record wrong."""


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VERSIONS):
        raise UnsupportedVllm(
            "schedtop's vLLM recorder supports vLLM "
            + ", ".join(v + "x" for v in SUPPORTED_VERSIONS)
            + f"; this is vLLM {version}. Run without --scheduler-cls, or install a schedtop "
            "that supports this vLLM."
        )


def setup_problems(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_bs: int
) -> list[str]:
    """Why this vLLM set-up cannot be recorded faithfully (empty: it can)."""
    sc = vllm_config.scheduler_config
    problems = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("a KV connector (kv_transfer_config) is configured")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding is on")
    if getattr(vllm_config, "lora_config", None) is not None:
        problems.append("LoRA is on (max_loras changes admission)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        problems.append(f"{len(groups)} KV cache groups (hybrid / sliding-window / Mamba models)")
    else:
        spec = type(groups[0].kv_cache_spec).__name__
        if spec != "FullAttentionSpec":
            problems.append(f"KV cache spec {spec} (only full attention is modelled)")
    if hash_bs != block_size:
        problems.append(f"hash_block_size {hash_bs} differs from block_size {block_size}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (more than two batches in flight)")
    if getattr(sc, "local_prefill_interval", 1) > 1:
        problems.append("local_prefill_interval > 1 (prefill throttling)")
    if getattr(vllm_config.cache_config, "deterministic_prefix_caching", False):
        problems.append("deterministic_prefix_caching (block-aligned prefill splits)")
    return problems


def request_problem(request: Any) -> str:
    """Why a request's scheduling cannot be recorded faithfully ("" if it can)."""
    if request.pooling_params is not None:
        return "a pooling request"
    if getattr(request, "mm_features", None):
        return "multimodal inputs (encoder budget)"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "use_structured_output", False):
        return "structured output (grammar compilation delays admission)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(request, "cache_salt", None):
        return "a cache salt (prefix hashes schedtop does not compute)"
    if getattr(request, "resumable", False):
        return "a resumable (streaming session) request"
    return ""


def engine_config(
    sched: Any, async_scheduling: bool, block_size: int, num_blocks: int
) -> EngineConfig:
    """vLLM's scheduler config under schedtop's names."""
    vc = sched.vllm_config
    sc = vc.scheduler_config
    active = getattr(sched, "max_num_active_reqs", sc.max_num_seqs)
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=sched.max_num_scheduled_tokens,
        max_num_seqs=sc.max_num_seqs,
        max_num_active_seqs=None if active == sc.max_num_seqs else active,
        max_model_len=sched.max_model_len,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=bool(
            getattr(sc, "long_prefill_token_threshold_adaptive", False)
        ),
        policy=str(sched.policy.value),
        enable_prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        watermark=float(getattr(sc, "watermark", 0.0)),
        scheduler_reserve_full_isl=bool(getattr(sched, "scheduler_reserve_full_isl", True)),
        async_scheduling=async_scheduling,
    )


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise UnsupportedVllm(f"{name}={raw!r}: expected a number") from None


class _Facade:
    """What Recorder reads from an engine, answered from vLLM's scheduler."""

    def __init__(self, config: EngineConfig, snapshot: Callable[[], Snapshot]) -> None:
        self.config = config
        self.step_index = 0
        self.sink = NULL_SINK
        self.runner = None
        self._snapshot = snapshot

    def snapshot(self) -> Snapshot:
        return self._snapshot()


class _Step:
    """What one step has seen so far."""

    def __init__(self, index: int, budget: int) -> None:
        self.index = index
        self.budget = budget  # tokens left in the step's budget
        self.run_used = 0  # tokens the running pass scheduled (net of give-backs)
        self.scheduled: dict[str, int] = {}  # allocations that succeeded, by request
        self.shortfalls: list[Shortfall] = []
        self.admissions: list[Admission] = []
        self.preemptions: list[Preemption] = []
        self.pending: tuple[str, int, Reason | None] | None = None  # (id, wanted, reason)
        self.wait_fail: Reason | None = None  # why the head of waiting was not admitted
        self.decided = False  # schedule() has returned
        self.schedule_ns = 0  # time in schedule()
        self.arrivals: tuple[Arrival, ...] = ()  # added before schedule()
        self.entries: tuple[Scheduled, ...] = ()  # what schedule() decided, in order
        self.running_stop: QueueStop | None = None
        self.waiting_stop: QueueStop | None = None
        self.free_after_schedule = 0  # free blocks right after schedule()
        self.finishes: list[Finish] = []  # aborts before schedule(), then the rest
        self.samples: dict[int, tuple[int, ...]] = {}  # ref -> tokens that arrived


class Tap:
    """All the recording state, kept apart from vLLM's scheduler attributes."""

    def __init__(self, sched: Any, is_async: bool, block_size: int, num_blocks: int) -> None:
        self.sched = sched
        self.kvm = sched.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.block_size = block_size
        self.config = engine_config(sched, is_async, block_size, num_blocks)
        self.is_async = is_async
        self.kv = KVEventLog()
        self.hashes: dict[str, list[bytes]] = {}  # request id -> schedtop hashes of its blocks
        self.block_hash: dict[int, bytes] = {}  # block id -> schedtop hash, for cached blocks
        self.cached: dict[str, int] = {}  # request id -> leading blocks of its table cached
        self.live: dict[str, Any] = {}  # request id -> vLLM request, until it finishes
        self.refs: dict[str, int] = {}  # request id -> ref, until it finishes
        self.next_ref = 0
        # ref -> [arrival_step, first_scheduled_step, first_token_step, prefix-hit tokens]
        self.progress: dict[int, list[int]] = {}
        self.arrivals: list[Arrival] = []
        self.finishes: list[Finish] = []
        self.step: _Step | None = None
        self.next_step = 0
        self.alloc_for: str | None = None  # the request whose allocation is running
        self.last_flush = time.monotonic()
        self.flush_interval = _env_number("SCHEDTOP_FLUSH_INTERVAL_S", 1.0)
        self.stopped: str | None = None  # why recording stopped
        self.redact = _env_flag("SCHEDTOP_REDACT_PROMPTS")
        self.recorder: Recorder | None = None
        self.writer: TraceWriter | None = None
        self.threshold = 0  # the step's long-prefill cap (0: off)
        self.pre_running: list[str] = []  # running queue when schedule() began
        self.in_flight = 0  # async: batches scheduled and not updated yet

    # -- opening and closing ---------------------------------------------------------------

    def open(self, path: Path, engine_name: str, model: str, on_record: Any) -> None:
        self.writer = TraceWriter(path, live=False, flush_interval_s=self.flush_interval)
        facade = _Facade(self.config, self.snapshot)
        self.recorder = Recorder(
            cast(EngineCore, facade),
            self.writer,
            redact_prompts=self.redact,
            snapshot_interval=int(
                _env_number("SCHEDTOP_SNAPSHOT_INTERVAL", DEFAULT_SNAPSHOT_INTERVAL)
            ),
            model=model,
            engine_name=engine_name,
            on_step_record=on_record,
        )
        self._install()

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    def stop(self, why: str) -> None:
        """Stop recording for good (the engine goes on); the file keeps what it has."""
        if self.stopped is None:
            self.stopped = why
            log.warning("schedtop recording stopped: %s", why)
            self.close()

    def flush(self) -> None:
        if self.writer is not None and self.stopped is None:
            self.writer.flush()
        self.last_flush = time.monotonic()

    # -- taps on the KV cache manager and block pool ------------------------------------------

    def _install(self) -> None:
        kvm, pool = self.kvm, self.pool
        allocate, free, cache = kvm.allocate_slots, kvm.free, kvm.cache_blocks
        evict = pool._maybe_evict_cached_block
        evicted: list[int] = []

        def maybe_evict(block: Any) -> bool:
            gone = bool(evict(block))
            if gone:
                evicted.append(block.block_id)
            return gone

        from vllm.v1.request import RequestStatus as VllmStatus

        running_status = VllmStatus.RUNNING
        tables = self.tables
        cached = self.cached
        kv = self.kv_log
        refs = self.refs

        def allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kw: Any) -> Any:
            rid = request.request_id
            self.alloc_for = rid
            step = self.step
            if request.status is running_status and not args and "new_computed_blocks" not in kw:
                # The running pass: every running request, every step. Kept lean.
                if step is not None:
                    pending = step.pending
                    if pending is None or pending[0] != rid:
                        wanted = (
                            request.num_tokens_with_spec
                            + request.num_output_placeholders
                            - request.num_computed_tokens
                        )
                        if wanted != num_new_tokens:  # cut short: say why, as schedtop would
                            step.pending = self._running_share(step, request, num_new_tokens)
                if evicted:
                    evicted.clear()
                out = allocate(request, num_new_tokens, *args, **kw)
                if out is None:
                    return out  # a preemption follows, and a retry
                new = out.blocks[0]
                if evicted:
                    self._evicted(evicted)
                if new:
                    kv().add(KVEventKind.ALLOCATED, refs[rid], [b.block_id for b in new])
                table = tables[rid]
                done = cached.get(rid, 0)
                if done < len(table) and table[done].block_hash is not None:
                    self._on_cached(request)
                if step is not None:
                    pending = step.pending
                    if pending is not None and pending[0] == rid:
                        step.pending = None
                        if pending[2] is not None:
                            step.shortfalls.append(
                                Shortfall(refs[rid], pending[1], num_new_tokens, pending[2])
                            )
                    step.scheduled[rid] = num_new_tokens
                    step.budget -= num_new_tokens
                    step.run_used += num_new_tokens
                return out
            hits = kw.get("new_computed_blocks", args[1] if len(args) > 1 else None)
            num_hit_tokens = kw.get("num_new_computed_tokens", args[0] if args else 0)
            before = len(self._table(rid))
            evicted.clear()
            out = allocate(request, num_new_tokens, *args, **kw)
            self._on_allocate(request, num_new_tokens, num_hit_tokens, hits, before, out, evicted)
            return out

        def free_request(request: Any) -> None:
            table = self._table(request.request_id)
            ids = [b.block_id for b in reversed(table)]
            free(request)
            if ids:
                self.kv.add(KVEventKind.FREED, self.refs[request.request_id], ids)
            self.cached.pop(request.request_id, None)

        def cache_blocks(request: Any, num_computed_tokens: int) -> None:
            cache(request, num_computed_tokens)
            self._on_cached(request)

        pool._maybe_evict_cached_block = maybe_evict
        kvm.allocate_slots = allocate_slots
        kvm.free = free_request
        kvm.cache_blocks = cache_blocks

    @property
    def tables(self) -> dict[str, list[Any]]:
        """vLLM's block tables (full attention: one KV cache group), by request id."""
        return cast(
            dict[str, list[Any]], self.kvm.coordinator.single_type_managers[0].req_to_blocks
        )

    def kv_log(self) -> KVEventLog:
        return self.kv

    def _table(self, rid: str) -> list[Any]:
        return self.tables.get(rid, [])

    def _evicted(self, evicted: list[int]) -> None:
        self.kv.add(
            KVEventKind.EVICTED, None, list(evicted), [self.block_hash.pop(b) for b in evicted]
        )
        evicted.clear()

    def _on_allocate(
        self,
        request: Any,
        n: int,
        num_hit_tokens: int,
        hits: Any,
        before: int,
        out: Any,
        evicted: list[int],
    ) -> None:
        rid = request.request_id
        step = self.step
        if out is None:
            if step is not None and request.status.name != "RUNNING":
                step.wait_fail = self._admission_failure(request, n, num_hit_tokens, hits)
            return
        table = self._table(rid)
        hit_ids = [b.block_id for b in hits.blocks[0]] if hits is not None and hits.blocks else []
        if hit_ids:
            self.kv.add(KVEventKind.PREFIX_HIT, self.refs[rid], hit_ids, num_tokens=num_hit_tokens)
            self.cached[rid] = before + len(hit_ids)
        if evicted:
            self._evicted(evicted)
        new = table[before + len(hit_ids) :]
        if new:
            self.kv.add(KVEventKind.ALLOCATED, self.refs[rid], [b.block_id for b in new])
        self._on_cached(request)
        if step is not None:
            self._count_allocation(step, request, n, num_hit_tokens)

    def _on_cached(self, request: Any) -> None:
        """CACHED for the request's table blocks that got a hash since the last look."""
        rid = request.request_id
        table = self._table(rid)
        done = self.cached.get(rid, 0)
        end = done
        while end < len(table) and table[end].block_hash is not None:
            end += 1
        if end == done:
            return
        ours = self._hashes(request, end)
        ids = [b.block_id for b in table[done:end]]
        new_hashes = ours[done:end]
        self.block_hash.update(zip(ids, new_hashes))
        self.kv.add(KVEventKind.CACHED, self.refs[rid], ids, new_hashes)
        self.cached[rid] = end

    def _hashes(self, request: Any, count: int) -> list[bytes]:
        """schedtop's hashes of the request's first `count` full blocks."""
        hashes = self.hashes.setdefault(request.request_id, [])
        if len(hashes) < count:
            tokens = request.all_token_ids
            bs = self.block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            for i in range(len(hashes), count):
                parent = hash_block(parent, list(tokens[i * bs : (i + 1) * bs]))
                hashes.append(parent)
        return hashes

    def _admission_failure(self, request: Any, n: int, num_hits: int, hits: Any) -> Reason:
        """Which admission test failed: the same three as schedtop's scheduler."""
        free = self.pool.get_num_free_blocks()
        hit_blocks = hits.blocks[0] if hits is not None and hits.blocks else []
        held = len(self._table(request.request_id))

        def needed(num_tokens: int) -> int:
            required = -(-num_tokens // self.block_size)
            fresh = max(required - held - len(hit_blocks), 0)
            return fresh + sum(1 for b in hit_blocks if b.ref_cnt == 0)

        max_len = self.config.max_model_len
        if needed(min(num_hits + n, max_len)) > free:
            return Reason.KV_BLOCKS
        if (
            self.config.scheduler_reserve_full_isl
            and needed(min(request.num_tokens, max_len)) > free
        ):
            return Reason.FULL_PROMPT
        return Reason.WATERMARK

    # -- the decisions -------------------------------------------------------------------------

    def _count_allocation(self, step: _Step, request: Any, n: int, num_hits: int) -> None:
        """An admission from waiting (running requests take the fast path)."""
        rid = request.request_id
        wanted = request.num_tokens - num_hits
        reason = None
        threshold = self.threshold
        if 0 < threshold < wanted:
            reason = Reason.LONG_PREFILL_THRESHOLD
            if threshold > step.budget:
                reason = Reason.TOKEN_BUDGET
        elif wanted > step.budget:
            reason = Reason.TOKEN_BUDGET
        ref = self.refs[rid]
        if reason is not None:
            step.shortfalls.append(Shortfall(ref, wanted, n, reason))
        step.admissions.append(Admission(ref, num_hits, request.status.name == "PREEMPTED"))
        progress = self.progress[ref]
        if progress[1] < 0:
            progress[1] = step.index
            progress[3] = num_hits
        step.scheduled[rid] = n
        step.budget -= n

    def _running_share(self, step: _Step, request: Any, n: int) -> tuple[str, int, Reason | None]:
        """A running request's wanted tokens and why it got fewer (schedtop's rules), as
        the budget stands at its first allocation attempt."""
        computed = request.num_computed_tokens
        wanted = request.num_tokens_with_spec + request.num_output_placeholders - computed
        if n == wanted:
            return (request.request_id, wanted, None)
        m, reason = wanted, None
        if 0 < self.threshold < m:
            m, reason = self.threshold, Reason.LONG_PREFILL_THRESHOLD
        if m > step.budget:
            m, reason = step.budget, Reason.TOKEN_BUDGET
        if m > self.config.max_model_len - 1 - computed:
            reason = Reason.MAX_MODEL_LEN
        return (request.request_id, wanted, reason)

    def on_preempt(self, victim: Any) -> None:
        step = self.step
        if step is None:
            self.stop("a preemption outside schedule() (reset_prefix_cache with running requests)")
            return
        rid = victim.request_id
        ref = self.refs[rid]
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
        self.live[rid] = request
        self.progress[ref] = [self.next_step, -1, -1, -1]
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
                SamplingParams(
                    max_tokens=request.max_tokens,
                    temperature=float(sp.temperature),
                    top_p=float(sp.top_p),
                    top_k=max(int(sp.top_k or 0), 0),
                    seed=sp.seed,
                    stop_token_ids=tuple(sp.stop_token_ids or ()),
                    ignore_eos=False,  # vLLM clears eos_token_id instead
                ),
                prompt,
                tuple(self._hashes(request, full)) if self.redact else None,
            )
        )

    def on_finished(self, requests: Iterable[Any], status: Any) -> None:
        """Requests finished from outside (aborts, stop strings): before the next
        schedule(), or between schedule() and update (then the message says so)."""
        step = self.step
        mid_step = step is not None and step.decided
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
            else:
                self.finishes.append(finish)
            self._forget(req.request_id)

    def _forget(self, rid: str) -> None:
        self.live.pop(rid, None)
        ref = self.refs.pop(rid, None)
        if ref is not None:
            self.progress.pop(ref, None)
        self.hashes.pop(rid, None)
        self.cached.pop(rid, None)

    def before_schedule(self) -> None:
        if self.step is not None:
            self.end_step(0)  # the previous step had no update (async queue filling)
        sched = self.sched
        num_eligible = len(sched.running) + len(sched.waiting)
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold and cfg.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, cfg.max_num_batched_tokens // num_eligible)
        self.threshold = threshold
        self.pre_running = [r.request_id for r in sched.running]
        self.step = _Step(self.next_step, cfg.max_num_batched_tokens)

    def after_schedule(self, out: Any, seconds: float, launched: bool = True) -> None:
        step = self.step
        assert step is not None
        sched = self.sched
        requests = sched.requests
        refs = self.refs
        entries: list[Scheduled] = []
        append = entries.append
        chunk, decode, prefill = Kind.CHUNK, Kind.DECODE, Kind.PREFILL
        for rid, n in out.num_scheduled_tokens.items():
            req = requests[rid]
            if req.is_prefill_chunk:
                kind = chunk
            elif n == 1 and req.output_token_ids:  # as schedtop labels it
                kind = decode
            else:
                kind = prefill
            append(Scheduled(refs[rid], n, kind, req.num_computed_tokens - n))
        step.entries = tuple(entries)
        step.arrivals = tuple(self.arrivals)
        step.finishes = self.finishes
        step.running_stop = self._running_stop(step)
        step.waiting_stop = self._waiting_stop(step)
        step.free_after_schedule = self.pool.get_num_free_blocks()
        step.schedule_ns = ns(seconds)
        step.decided = True
        self.arrivals, self.finishes = [], []
        if self.is_async and launched:
            # vLLM's EngineCore (step_with_batch_queue) fills its two-batch queue
            # before it waits for the oldest batch: then no update follows this step.
            self.in_flight += 1
            if self.in_flight < 2 and (out.num_scheduled_tokens or sched.has_requests()):
                self.end_step(0)

    def _running_stop(self, step: _Step) -> QueueStop | None:
        fcfs = self.config.policy == "fcfs"
        if fcfs and any(p.victim == p.for_request for p in step.preemptions):
            return QueueStop(Reason.KV_BLOCKS, Reason.KV_BLOCKS)
        if self.config.max_num_batched_tokens - step.run_used > 0:
            return None
        before = set(self.pre_running)
        still = [r.request_id for r in self.sched.running if r.request_id in before]
        last = max((i for i, rid in enumerate(still) if rid in step.scheduled), default=-1)
        if last < len(still) - 1:
            return QueueStop(Reason.TOKEN_BUDGET, Reason.TOKEN_BUDGET)
        return None

    def _waiting_stop(self, step: _Step) -> QueueStop | None:
        sched = self.sched
        if step.preemptions:
            return QueueStop(Reason.PREEMPTION, Reason.PREEMPTION) if sched.waiting else None
        left = any(not r.num_stale_output_tokens for r in sched.waiting)
        if not left:
            return None
        if step.wait_fail is not None:
            return QueueStop(step.wait_fail, Reason.HEAD_OF_LINE)
        if step.budget <= 0:
            return QueueStop(Reason.TOKEN_BUDGET, Reason.TOKEN_BUDGET)
        limit = self.config.max_num_active_seqs or self.config.max_num_seqs
        if len(sched.running) >= limit:
            return QueueStop(Reason.MAX_NUM_SEQS, Reason.MAX_NUM_SEQS)
        if not self.config.enable_chunked_prefill:
            return QueueStop(Reason.NO_CHUNKING, Reason.HEAD_OF_LINE)
        return None

    def after_update(self, batch: Any, outputs: Any, seconds: float) -> None:
        """The samples and finishes of an executed batch (this step's, or with async
        scheduling the one before), then the end of the step."""
        if self.step is None or not self.step.decided:
            self.before_schedule()  # vLLM updated without scheduling: an empty step
            self.after_schedule(_EmptyOutput(), 0.0, launched=False)
        step = self.step
        assert step is not None
        if self.is_async:
            self.in_flight = max(self.in_flight - 1, 0)
        samples = step.samples
        refs = self.refs
        progress = self.progress
        index = step.index
        # vLLM emits outputs in the batch's scheduling order (per client).
        for engine_outputs in outputs.values():
            for o in engine_outputs.outputs:
                tokens = o.new_token_ids
                ref = refs.get(o.request_id)
                if ref is None:
                    continue
                if tokens:
                    samples[ref] = tuple(tokens)
                    first = progress[ref]
                    if first[2] < 0:
                        first[2] = index
                if o.finish_reason is None:
                    continue
                req = self.live.get(o.request_id)
                status = _FINISHED.get(req.status.name if req is not None else "")
                step.finishes.append(Finish(ref, status or Status.FINISHED_ERROR, ""))
                self._forget(o.request_id)
        self.end_step(ns(seconds))

    def end_step(self, update_ns: int) -> None:
        step = self.step
        assert step is not None
        self.step = None
        sched = self.sched
        refs = self.refs
        counts, tokens, others = _layout(step.entries, step.samples)
        record = Step(
            step=step.index,
            schedule_ns=step.schedule_ns,
            update_ns=update_ns,
            token_budget=self.config.max_num_batched_tokens,
            arrivals=step.arrivals,
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
            kv_events=self.kv.freeze(),
            free_blocks_after_schedule=step.free_after_schedule,
            free_blocks=self.pool.get_num_free_blocks(),
            running=tuple(refs[r.request_id] for r in sched.running),
            waiting=tuple(refs[r.request_id] for r in sched.waiting),
        )
        self.kv = KVEventLog()
        self.next_step += 1
        if self.recorder is not None and self.stopped is None:
            self.recorder.on_step(record)
            if self.recorder.error is not None:
                self.stop(self.recorder.error)
            elif not sched.has_unfinished_requests() or (
                time.monotonic() - self.last_flush >= self.flush_interval
            ):
                self.flush()  # idle, or due: a reader sees every step so far

    def snapshot(self) -> Snapshot:
        sched = self.sched
        refs = self.refs
        reqs = []
        for rid, r in sched.requests.items():
            ref = refs[rid]
            arrival_step, first_scheduled, first_token, hits = self.progress[ref]
            reqs.append(
                RequestState(
                    ref,
                    rid,
                    _UNFINISHED.get(r.status.name, Status.WAITING),
                    r.num_prompt_tokens,
                    len(r.output_token_ids),
                    r.num_computed_tokens,
                    tuple(b.block_id for b in self._table(rid)),
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
        free = [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]
        cached = sorted(self.block_hash.items())
        return Snapshot(
            step=self.next_step - 1,
            next_ref=self.next_ref,
            requests=tuple(reqs),
            running=tuple(refs[r.request_id] for r in sched.running),
            waiting=tuple(refs[r.request_id] for r in sched.waiting),
            free_queue=tuple(free),
            cached_block_ids=tuple(b for b, _ in cached),
            cached_hashes=tuple(h for _, h in cached),
        )

    def on_reset_prefix_cache(self) -> None:
        """Every cached hash is dropped: EVICTED for each, as the reducer expects."""
        if self.block_hash:
            ids = sorted(self.block_hash)
            self.kv.add(KVEventKind.EVICTED, None, ids, [self.block_hash[b] for b in ids])
            self.block_hash.clear()


def _layout(
    entries: tuple[Scheduled, ...], samples: dict[int, tuple[int, ...]]
) -> tuple[tuple[int, ...] | None, tuple[int, ...], tuple[Sample, ...]]:
    """Samples laid out against the step's entries: per-entry counts (None: one each),
    the tokens in entry order, and samples of requests without an entry (async: the
    previous batch's, of a request not scheduled again)."""
    if not samples:
        return ((0,) * len(entries) if entries else None), (), ()
    pop = samples.pop
    per_entry = [pop(e.ref, ()) for e in entries]
    flat = tuple(t for toks in per_entry for t in toks)
    others = tuple(Sample(ref, len(toks), toks) for ref, toks in samples.items())
    counts = tuple(map(len, per_entry))
    if not others and len(flat) == len(counts) and 0 not in counts:
        return None, flat, ()
    return counts, flat, others


class _EmptyOutput:
    num_scheduled_tokens: dict[str, int] = {}


class RecordingMixin:
    """The taps, mixed into vLLM's Scheduler or AsyncScheduler (see RecordingScheduler)."""

    _schedtop: Tap | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import vllm
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        check_version(vllm.__version__)
        super().__init__(*args, **kwargs)
        sched: Any = self
        for what, names in _REQUIRED.items():
            owner = {
                "scheduler": sched,
                "kv_cache_manager": getattr(sched, "kv_cache_manager", None),
                "block_pool": getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None),
            }[what]
            missing = [n for n in names if not hasattr(owner, n)]
            if missing:
                raise UnsupportedVllm(
                    f"vLLM {vllm.__version__}: the {what} has no {', '.join(missing)}; "
                    "schedtop's recorder cannot tap it"
                )
        vllm_config = sched.vllm_config
        kv_cfg = kwargs.get("kv_cache_config") or args[1]
        block_size = int(kwargs.get("block_size") or vllm_config.cache_config.block_size)
        hash_bs = int(kwargs.get("hash_block_size") or block_size)
        problems = setup_problems(vllm_config, kv_cfg, block_size, hash_bs)
        if problems:
            raise UnsupportedVllm(
                "schedtop cannot record this vLLM set-up: "
                + "; ".join(problems)
                + ". Run without --scheduler-cls recorder.vllm.RecordingScheduler."
            )
        is_async = isinstance(self, AsyncScheduler)
        tap = Tap(sched, is_async, block_size, int(kv_cfg.num_blocks))
        pc = vllm_config.parallel_config
        rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        path = _trace_path(rank if pc.data_parallel_size > 1 else None)
        model = str(getattr(vllm_config.model_config, "model", ""))
        name = (
            f"vLLM {vllm.__version__} ({'AsyncScheduler' if is_async else 'Scheduler'}"
            + (f", DP rank {rank} of {pc.data_parallel_size}" if pc.data_parallel_size > 1 else "")
            + ")"
        )
        check = self.schedtop_check
        tap.open(path, name, model, check)
        self._schedtop = tap
        self.schedtop_trace = path
        log.info("schedtop: recording vLLM's scheduler into %s", path)

    # Tests override this: it sees every step record, with vLLM's state at the step's end.
    schedtop_check: Callable[[Step], None] | None = None

    def add_request(self, request: Any) -> None:
        super().add_request(request)  # type: ignore[misc]
        tap = self._schedtop
        if tap is not None and tap.stopped is None:
            tap.on_add(request)

    def finish_requests(self, request_ids: Any, finished_status: Any, *a: Any, **kw: Any) -> Any:
        done = super().finish_requests(request_ids, finished_status, *a, **kw)  # type: ignore[misc]
        tap = self._schedtop
        if tap is not None and tap.stopped is None and done:
            tap.on_finished(done, finished_status)
        return done

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        tap = self._schedtop
        if tap is not None and tap.stopped is None:
            tap.on_preempt(request)
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        tap = self._schedtop
        if tap is None or tap.stopped is not None:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        tap.before_schedule()
        t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        seconds = time.perf_counter() - t0
        tap.after_schedule(out, seconds)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        tap = self._schedtop
        if tap is None or tap.stopped is not None:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        t0 = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        tap.after_update(scheduler_output, outputs, time.perf_counter() - t0)
        return outputs

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        ok = super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        tap = self._schedtop
        if ok and tap is not None and tap.stopped is None:
            tap.on_reset_prefix_cache()
        return ok

    def shutdown(self) -> None:
        tap = self._schedtop
        if tap is not None:
            tap.close()
        super().shutdown()  # type: ignore[misc]


def _trace_path(dp_rank: int | None) -> Path:
    exact = os.environ.get("SCHEDTOP_TRACE_FILE")  # one file, for drivers and tests
    if exact:
        return Path(exact)
    directory = trace_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecordingError(
            f"{directory}: cannot create the trace directory: {e.strerror}"
        ) from None
    now = time.time_ns()
    seconds, rest = divmod(now, 1_000_000_000)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds))
    rank = f"-dp{dp_rank}" if dp_rank is not None else ""
    host = socket.gethostname().split(".")[0]
    return directory / f"{stamp}.{rest // 1_000_000:03d}-vllm-{host}-{os.getpid()}{rank}.trace"


_COMPOSED: dict[tuple[type, type], type] = {}


def compose(mixin: type, base: type) -> type:
    """`mixin` over vLLM's `base` scheduler class (cached, so pickles and isinstance work)."""
    key = (mixin, base)
    cls = _COMPOSED.get(key)
    if cls is None:
        cls = type(f"Recording{base.__name__}", (mixin, base), {"__module__": __name__})
        _COMPOSED[key] = cls
    return cls


class RecordingScheduler:
    """The class to give vLLM: `--scheduler-cls recorder.vllm.RecordingScheduler`.

    vLLM calls it with the scheduler's keyword arguments; it builds the scheduler vLLM
    would have used without it (AsyncScheduler when async scheduling is on, else
    Scheduler) with the recording taps mixed in. Subclasses may set `mixin`."""

    mixin: type = RecordingMixin

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        vllm_config = kwargs.get("vllm_config") or args[0]
        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler
        impl: Any = compose(cls.mixin, base)
        # Not an instance of cls, so Python will not call __init__ on it: do it here.
        obj = impl.__new__(impl)
        obj.__init__(*args, **kwargs)
        return obj
