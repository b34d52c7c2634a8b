"""What the engine tells an operator about itself: a small, read-only stats API.

A server's metrics (Prometheus gauges and counters) and its back-pressure read these
instead of the scheduler's queues and block pool, so that the scheduler's internals can
change without the layers above noticing. Pure Python, like the scheduling path."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load at one moment (between two steps)."""

    num_running: int  # requests in the running queue
    num_waiting: int  # requests waiting to be admitted (new and preempted)
    num_free_blocks: int  # KV blocks free now (cached-but-unused blocks count as free)
    num_usable_blocks: int  # KV blocks requests can ever hold (the pool less the null block)

    @property
    def kv_usage(self) -> float:
        """The share of usable KV blocks in use, 0..1 (vLLM's kv_cache_usage_perc)."""
        if self.num_usable_blocks <= 0:
            return 0.0
        return (self.num_usable_blocks - self.num_free_blocks) / self.num_usable_blocks


@dataclass(frozen=True, slots=True)
class Admitted:
    """One request the step admitted from the waiting queue."""

    request_id: str  # the caller's id
    num_prompt_tokens: int  # its prompt's length
    num_cached_tokens: int  # prompt tokens found in the prefix cache at admission
    resumed: bool  # it had been preempted and now resumes (not a new admission)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step did, in the terms a server's metrics count."""

    num_scheduled_tokens: int  # tokens computed this step (the budget used)
    num_preemptions: int  # requests preempted this step
    admitted: tuple[Admitted, ...]  # admissions, in order
