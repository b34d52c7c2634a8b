"""How many CPU threads to run torch with, decided by measuring.

On a machine shared with other busy processes, torch's OpenMP threads wait at every
barrier for a sibling that the kernel has descheduled: two threads can then be several
times slower than one. The only reliable test is to time both, so the runner times a
small matrix product with each thread count now and then, and keeps the faster."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

REPROBE_S = 20.0  # seconds between measurements while a run goes on
_REPEATS = 3  # best of this many timings per thread count


class ThreadTuner:
    """Picks torch's CPU thread count, between 1 and the machine's default."""

    def __init__(self, max_threads: int | None = None) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.threads = self.max_threads
        self.last_probe = float("-inf")
        self._a = torch.randn(64, 576)
        self._w = torch.randn(1536, 576)

    def maybe_probe(self, now: float | None = None) -> int:
        """Re-measure if REPROBE_S has passed since the last time; returns the count."""
        now = time.monotonic() if now is None else now
        if now - self.last_probe >= REPROBE_S:
            self.probe()
            self.last_probe = now
        return self.threads

    def probe(self) -> int:
        if self.max_threads <= 1:
            return self.threads
        timings = {n: self._time(n) for n in (self.max_threads, 1)}
        self.threads = min(timings, key=lambda n: timings[n])
        torch.set_num_threads(self.threads)
        return self.threads

    def _time(self, threads: int) -> float:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            F.linear(self._a, self._w)  # warm the thread pool
            best = float("inf")
            for _ in range(_REPEATS):
                start = time.perf_counter()
                for _ in range(4):
                    F.linear(self._a, self._w)
                best = min(best, time.perf_counter() - start)
        return best
