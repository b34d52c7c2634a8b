"""The scheduler class vLLM is given: its own scheduler with the recording taps mixed in."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine.records import Step
from recorder.errors import RecordingError
from recorder.vllm.checks import (
    UnsupportedVllm,
    check_attributes,
    check_version,
    data_parallel_rank,
    setup_problems,
    trace_path,
)
from recorder.vllm.live import LockingMixin, live_port_asked
from recorder.vllm.live import settings as live_settings
from recorder.vllm.tap import Tap

log = logging.getLogger("schedtop.recorder.vllm")


class RecordingMixin:
    """The taps, mixed into vLLM's Scheduler or AsyncScheduler (see RecordingScheduler)."""

    _schedtop: Tap | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import vllm
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        check_version(vllm.__version__)
        super().__init__(*args, **kwargs)
        sched: Any = self
        check_attributes(sched, vllm.__version__)
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
        dp = data_parallel_rank(vllm_config.parallel_config)
        dp_rank = None if dp is None else dp[0]
        model = str(getattr(vllm_config.model_config, "model", ""))
        # replays.ranks reads the rank (and the size, when vLLM still knows it) from here
        rank_label = "" if dp is None else f", DP rank {dp[0]}" + (f" of {dp[1]}" if dp[1] else "")
        name = (
            f"vLLM {vllm.__version__} ({'AsyncScheduler' if is_async else 'Scheduler'}{rank_label})"
        )
        check = self.schedtop_check
        try:
            segments = live_settings()
        except RecordingError as e:
            raise UnsupportedVllm(str(e)) from None
        if segments.segmented:  # rotation, incidents, a live port (recorder.vllm.live)
            lock = getattr(self, "_schedtop_lock", None)
            path = tap.open_segments(segments, dp_rank, name, model, check, lock)
        else:
            path = trace_path(dp_rank)
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
        c0 = time.thread_time_ns()
        t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        seconds = time.perf_counter() - t0
        tap.vllm_cpu_ns += time.thread_time_ns() - c0
        tap.after_schedule(out, seconds)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        tap = self._schedtop
        if tap is None or tap.stopped is not None:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        c0 = time.thread_time_ns()
        t0 = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        seconds = time.perf_counter() - t0
        tap.vllm_cpu_ns += time.thread_time_ns() - c0
        tap.after_update(scheduler_output, outputs, seconds)
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


_COMPOSED: dict[tuple[type, type], type] = {}


def compose(mixin: type, base: type) -> type:
    """`mixin` over vLLM's `base` scheduler class (cached, so pickles and isinstance work)."""
    key = (mixin, base)
    cls = _COMPOSED.get(key)
    if cls is None:
        cls = type(f"Recording{base.__name__}", (mixin, base), {"__module__": "recorder.vllm"})
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
        if live_port_asked():  # the HTTP side serves an idle vLLM under the lock
            impl = compose(LockingMixin, impl)
        # Not an instance of cls, so Python will not call __init__ on it: do it here.
        obj = impl.__new__(impl)
        obj.__init__(*args, **kwargs)
        return obj
