"""The hooks on SGLang's scheduler (installed through its HookRegistry) and the tap they
feed: one per scheduler process, made on its first step."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from recorder.sglang.tap import Tap

log = logging.getLogger("schedtop.recorder.sglang")

_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_TAP: Tap | None = None  # the scheduler process's (SGLang runs one scheduler per process)
_FAILED = False  # the tap could not start: SGLang goes on unrecorded


def _off() -> int:
    return 0


# The CPU clock of the recorder's own accounting (SCHEDTOP_COST_FILE, the overhead bench):
# the scheduler thread's time in the two hooks a step always runs, less SGLang's own in
# between. Off, it is a function that returns 0, so that a recording does not pay for
# reading a thread clock eight times a step; install() sets it.
_cpu = _off


def trace_path() -> Path:
    """SCHEDTOP_TRACE_FILE, else a new file in SCHEDTOP_TRACE_DIR (or the default)."""
    exact = os.environ.get("SCHEDTOP_TRACE_FILE")
    if exact:
        return Path(exact)
    from recorder.paths import trace_dir

    directory = trace_dir()
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time_ns()
    seconds, rest = divmod(now, 1_000_000_000)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds))
    host = socket.gethostname().split(".")[0]
    return directory / f"{stamp}.{rest // 1_000_000:03d}-sglang-{host}-{os.getpid()}.trace"


def _tap(sched: Any) -> Tap | None:
    global _TAP, _FAILED
    if _TAP is None and not _FAILED:
        try:
            _TAP = Tap.start(sched, trace_path())
        except Exception as e:  # a recorder that cannot start never stops SGLang
            _FAILED = True
            log.error("schedtop: not recording SGLang's scheduler: %s", e)
            if os.environ.get("SCHEDTOP_STRICT") == "1":  # tests: fail loudly
                raise
    return _TAP if _TAP is not None and _TAP.stopped is None else None


def get_next_batch_to_run(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
    c0 = _cpu()
    tap = _tap(sched)
    if tap is None:
        return original(sched, *args, **kwargs)
    tap.guard(tap.before_schedule)
    t0 = time.perf_counter_ns()
    c1 = _cpu()
    plan = original(sched, *args, **kwargs)
    c2 = _cpu()
    tap.guard(tap.after_schedule, plan.batch_to_run, time.perf_counter_ns() - t0)
    # the cost file's writing (at the step's end, in before_schedule) is the bench's
    tap.cpu_ns += c1 - c0 + _cpu() - c2 - tap.cost_write_ns
    tap.cost_write_ns = 0
    return plan


def process_batch_result(original: Any, sched: Any, batch: Any, result: Any) -> Any:
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    t0 = time.perf_counter_ns()
    c1 = _cpu()
    out = original(sched, batch, result)
    c2 = _cpu()
    if tap is not None:
        tap.guard(tap.on_result, batch, time.perf_counter_ns() - t0)
        tap.cpu_ns += c1 - c0 + _cpu() - c2
    return out


def retract_decode(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(batch, *args, **kwargs)
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    if tap is not None:
        tap.guard(tap.on_retract, out[0])
        tap.cpu_ns += _cpu() - c0
    return out


def add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    res = original(adder, req, *args, **kwargs)
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    if tap is not None:
        tap.attempts[req.rid] = res.name  # why the head of waiting stays there
        tap.cpu_ns += _cpu() - c0
    return res


def release_aborted_request(original: Any, sched: Any, req: Any) -> Any:
    out = original(sched, req)
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    if tap is not None:
        tap.guard(tap.on_abort, req)
    return out


def abort_request(original: Any, sched: Any, recv_req: Any) -> Any:
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    if tap is None:
        return original(sched, recv_req)
    # which requests it aborts is SGLang's to say (a rid prefix, or all): the live ones
    # whose state it changed
    before = [(r, r.to_finish) for r in sched.collect_inflight_reqs()]
    waiting = list(sched.waiting_queue)
    out = original(sched, recv_req)
    still = {id(r) for r in sched.waiting_queue}
    hit = [r for r, had in before if r.to_finish is not None and had is None]
    hit += [r for r in waiting if id(r) not in still]
    tap.guard(tap.on_abort_received, hit)
    return out


def add_request_to_queue(original: Any, sched: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(sched, req, *args, **kwargs)
    c0 = _cpu()
    tap = _tap(sched)
    if tap is not None and any(r is req for r in reversed(sched.waiting_queue)):
        tap.guard(tap.on_add, req)  # queued (SGLang may refuse it instead)
        tap.cpu_ns += _cpu() - c0
    return out


def evict(original: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    out = original(cache, *args, **kwargs)
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    if tap is not None:
        # the slots SGLang says it freed: one integer a call, no walk of the tree
        tap.guard(tap.on_evict, int(out.num_tokens_evicted))
        tap.cpu_ns += _cpu() - c0
    return out


def free(original: Any, allocator: Any, free_index: Any, *args: Any, **kwargs: Any) -> Any:
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    # a free inside a free group only queues the slots: they are free at its end, which
    # frees them all through here again
    record = (
        tap is not None
        and tap.slot_map
        and allocator.free_group is None
        and allocator is tap.sched.token_to_kv_pool_allocator
    )
    c1 = _cpu()
    out = original(allocator, free_index, *args, **kwargs)
    c2 = _cpu()
    if tap is not None:
        if record and free_index.numel():
            tap.guard(tap.on_free, free_index)
        tap.cpu_ns += c1 - c0 + _cpu() - c2
    return out


def checkpoint_into_tree(original: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    c0 = _cpu()
    tap = _TAP if _TAP is not None and _TAP.stopped is None else None
    before = int(req.kv.cache_protected_len)
    c1 = _cpu()
    out = original(cache, req, *args, **kwargs)
    c2 = _cpu()
    if tap is not None and tap.slot_map:
        tap.guard(tap.on_checkpoint, req, before)
        tap.cpu_ns += c1 - c0 + _cpu() - c2
    return out


def install() -> None:
    global _cpu
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if os.environ.get("SCHEDTOP_COST_FILE"):
        _cpu = time.thread_time_ns

    around = HookType.AROUND
    HookRegistry.register(f"{_SCHED}.get_next_batch_to_run", get_next_batch_to_run, around)
    HookRegistry.register(f"{_SCHED}.process_batch_result", process_batch_result, around)
    HookRegistry.register(f"{_SCHED}._add_request_to_queue", add_request_to_queue, around)
    HookRegistry.register(f"{_SCHED}._release_aborted_request", release_aborted_request, around)
    HookRegistry.register(f"{_SCHED}.abort_request", abort_request, around)
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode", retract_decode, around
    )
    HookRegistry.register(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", add_one_req, around
    )
    # every eviction of SGLang's default tree cache (UnifiedRadixCache: its evict and
    # evict_for_alloc both walk the tree in _evict) and of the plain RadixCache; caches
    # that replace both (FlexKV's) are not hooked and record none
    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache._evict", evict, around
    )
    HookRegistry.register("sglang.srt.mem_cache.radix_cache.RadixCache.evict", evict, around)
    # the slot map (format 1.9): every slot given back to the pool's allocator, and every
    # row the radix cache rewrites when it takes a request's tokens
    HookRegistry.register(
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free", free, around
    )
    HookRegistry.register(
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree",
        checkpoint_into_tree,
        around,
    )
