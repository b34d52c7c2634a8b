"""A recorder's encoding thread: the engine's thread hands it records to encode and append.

Encoding a step record costs about as much as everything else a recorder does in a step,
and none of it needs the engine's state: the record is immutable once built. vLLM's
engine core makes the same trade for its outputs (it serializes them on a thread of its
own, which runs while the GPU computes). `Background` runs the jobs in the order they
were put, so the file is the same as if the engine's thread had written it.

It is also the recorder's clock when the engine stops stepping: with a `tick`, the
thread wakes every `tick_s` seconds whatever the engine does, runs what is queued and
calls `tick` (the recorder's flush). A hung engine that is then killed (SIGKILL, the
usual end of a hung server) so loses at most the flush interval of steps: nothing else
writes while the engine does not step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

WAKE_EVERY = 64  # jobs put between two wake-ups: one GIL hand-over for this many steps
MAX_QUEUED = 4096  # jobs waiting beyond which put() waits (a stalled disk or writer)

log = logging.getLogger("schedtop.recorder")


class Background:
    """Runs jobs (a function and its arguments) one at a time, in order, on one thread.

    Invariant: only this thread calls the jobs, so a job may use a sink that is written
    from one thread only. `put` never blocks unless MAX_QUEUED jobs are waiting; jobs run
    at the latest once WAKE_EVERY are waiting, or on `wake`, `drain` or `close`, or with
    a `tick` every `tick_s` seconds, after which `tick` runs (on this thread, after every
    job put before it). Jobs report their own errors: one that raises is counted as done
    and the rest still run."""

    def __init__(
        self,
        name: str = "trace-encoder",
        max_queued: int = MAX_QUEUED,
        tick: Callable[[], object] | None = None,  # what it returns is not used
        tick_s: float = 0.0,
    ) -> None:
        if tick is not None and not tick_s > 0:
            raise ValueError(f"tick_s={tick_s}: must be > 0")
        self.max_queued = max_queued
        self._tick = tick
        self._tick_s = tick_s
        self._jobs: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._put = 0  # jobs put (the engine's thread writes it)
        self._done = 0  # jobs run (this thread writes it)
        self._closing = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def pending(self) -> int:
        """Jobs put and not yet run."""
        return self._put - self._done

    def put(self, fn: Callable[..., Any], *args: Any) -> None:
        self._jobs.append((fn, args))
        self._put += 1
        if self._put - self._done >= self.max_queued:
            self.drain()  # the queue is bounded: a slow disk holds the engine, not memory
        elif not self._put % WAKE_EVERY:
            self.wake()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every job put so far has run."""
        with self._cv:
            self._cv.notify_all()
            while self._done < self._put and self._thread.is_alive():
                self._cv.wait(0.1)

    def close(self) -> None:
        """Run what is queued, then stop the thread. Idempotent."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        jobs, cv = self._jobs, self._cv
        tick, tick_s = self._tick, self._tick_s
        next_tick = time.monotonic() + tick_s
        while True:
            with cv:
                while not jobs and not self._closing:
                    if tick is None:
                        cv.wait()
                        continue
                    left = next_tick - time.monotonic()
                    if left <= 0:
                        break  # time to tick, jobs or not
                    cv.wait(left)
                if not jobs and self._closing:
                    return
            self._run_jobs()
            if tick is not None and time.monotonic() >= next_tick:
                # Jobs put while the engine stepped are woken for only every WAKE_EVERY
                # puts: the tick is what runs them when it stops (and flushes them).
                next_tick = time.monotonic() + tick_s
                try:
                    tick()
                except Exception:
                    log.exception("the recorder's timed flush failed")

    def _run_jobs(self) -> None:
        jobs, cv = self._jobs, self._cv
        if jobs:
            while jobs:
                fn, args = jobs.popleft()
                try:
                    fn(*args)
                except Exception:  # jobs report their own errors; this one did not
                    log.exception("a trace encoding job failed")
                finally:
                    self._done += 1
            with cv:
                cv.notify_all()  # drain() may be waiting
