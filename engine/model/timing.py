"""Where a step's time goes, measured without stalling the device.

On CPU, work is synchronous: the host clock is exact. On CUDA, the runner records events
at the phase boundaries (and around every attention call) and reads them one step later,
when they have long completed, so that timing never waits for the GPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.attention.metadata import AttentionMetadata
from engine.records import Kernel, Timing, ns

MAX_KERNELS = 30  # kernels kept per profiled step, by total time


@dataclass
class _Pending:
    """One CUDA step's events, waiting to be read."""

    step: int  # the step they measure
    marks: dict[str, Any]  # phase name -> torch.cuda.Event
    attention: list[tuple[Any, Any]]  # (start, end) event pairs
    kernels: tuple[Kernel, ...] = ()  # the profile, if this step was profiled


@dataclass
class StepTimer:
    """Marks phase boundaries of one step at a time and yields Timing."""

    device: torch.device  # CUDA: events; anything else: host clock
    clock: Callable[[], float] = time.perf_counter  # the host clock
    _marks: dict[str, float] = field(default_factory=dict)  # phase -> host time (CPU)
    _attention_s: float = 0.0  # attention time so far this step (CPU)
    _attention_start: float = 0.0  # when the current attention call began (CPU)
    _pending: list[_Pending] = field(default_factory=list)  # CUDA steps not yet read
    _current: _Pending | None = None  # the CUDA step being recorded

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def begin(self, step: int) -> None:
        if self.cuda:
            self._current = _Pending(step, {}, [])
        self._marks = {}
        self._attention_s = 0.0
        self.mark("start")

    def mark(self, phase: str) -> None:
        if self._current is not None:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._current.marks[phase] = event
        else:
            self._marks[phase] = self.clock()

    def attention_begin(self) -> None:
        if self._current is not None:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._current.attention.append((event, None))
        else:
            self._attention_start = self.clock()

    def attention_end(self) -> None:
        if self._current is not None:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            start, _ = self._current.attention[-1]
            self._current.attention[-1] = (start, event)
        else:
            self._attention_s += self.clock() - self._attention_start

    def end(self, step: int, kernels: tuple[Kernel, ...] = ()) -> list[Timing]:
        """Close the step. Returns the timings resolved now: this step's on the host
        clock; on CUDA, those of earlier steps whose events have completed."""
        if self._current is None:
            m = self._marks
            return [
                Timing(
                    step,
                    ns(m["prepared"] - m["start"]),
                    ns(m["forwarded"] - m["prepared"]),
                    ns(self._attention_s),
                    ns(m["sampled"] - m["forwarded"]),
                    kernels,
                )
            ]
        self._current.kernels = kernels
        ready = self._pending  # earlier steps: their events are long done
        self._pending = [self._current]
        self._current = None
        return [_resolve(p) for p in ready]

    def flush(self) -> list[Timing]:
        """Every timing still pending (at the end of a run); waits for the device."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        ready, self._pending = self._pending, []
        return [_resolve(p) for p in ready]


def _resolve(p: _Pending) -> Timing:
    m = p.marks

    def span(a: str, b: str) -> int:
        return ns(float(m[a].elapsed_time(m[b])) / 1000.0)

    attention = sum(float(s.elapsed_time(e)) for s, e in p.attention if e is not None) / 1000.0
    return Timing(
        p.step,
        span("start", "prepared"),
        span("prepared", "forwarded"),
        ns(attention),
        span("forwarded", "sampled"),
        p.kernels,
    )


class TimedAttention:
    """Wraps an attention backend to time its calls into a StepTimer."""

    def __init__(self, inner: Any, timer: StepTimer) -> None:
        self.inner = inner
        self.timer = timer
        self.name = inner.name

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.timer.attention_begin()
        out = self.inner.forward(q, k, v, k_cache, v_cache, meta)
        self.timer.attention_end()
        return out  # type: ignore[no-any-return]


def kernel_stats(prof: Any, cuda: bool) -> tuple[Kernel, ...]:
    """Per-operator (CPU) or per-kernel (CUDA) totals from a finished torch.profiler run,
    largest first. Self time, so nested operators are not counted twice."""
    from torch.profiler import DeviceType

    stats = []
    for evt in prof.key_averages():
        if cuda:
            if evt.device_type != DeviceType.CUDA:
                continue  # the kernels themselves, not the operators that launched them
            total_us = float(getattr(evt, "self_device_time_total", 0.0))
        else:
            total_us = float(evt.self_cpu_time_total)
        if total_us > 0 and evt.count > 0:
            stats.append(Kernel(str(evt.key), int(evt.count), ns(total_us / 1e6)))
    stats.sort(key=lambda s: s.total_ns, reverse=True)
    return tuple(stats[:MAX_KERNELS])
