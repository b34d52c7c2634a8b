"""How many CPU threads to run torch with, decided by measuring.

On a machine shared with other busy processes, torch's OpenMP threads wait at every
barrier for a sibling that the kernel has descheduled: two threads can then be several
times slower than one. The only reliable test is to time both, so the runner times a
small matrix product with each thread count now and then, and keeps the faster.

The timings of the two counts are interleaved over several rounds, and each count keeps its
best: a burst of other work (in a server, the client and the event loop wake right after
each step, which is when the runner probes) then slows a timing of either count, not every
timing of the one measured first. Timed back to back, a burst that covered the first
count's timings made the tuner pick one thread for the next 20 s of a quiet machine."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

REPROBE_S = 20.0  # seconds between measurements while a run goes on
_ROUNDS = 4  # interleaved timings per thread count; each count keeps its best
_MARGIN = 0.9  # the other count must be this much faster (as a ratio) to switch to it


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
        best = {self.max_threads: float("inf"), 1: float("inf")}
        order = [self.max_threads, 1]
        for _ in range(_ROUNDS):
            for n in order:
                best[n] = min(best[n], self._time(n))
            order.reverse()  # neither count is always timed first
        other = 1 if self.threads != 1 else self.max_threads
        if best[other] < _MARGIN * best[self.threads]:
            self.threads = other
        torch.set_num_threads(self.threads)
        return self.threads

    def _time(self, threads: int) -> float:
        """Seconds for a few matrix products the size of one decode step's, on `threads`."""
        torch.set_num_threads(threads)
        with torch.inference_mode():
            F.linear(self._a, self._w)  # warm the thread pool
            start = time.perf_counter()
            for _ in range(4):
                F.linear(self._a, self._w)
            return time.perf_counter() - start
