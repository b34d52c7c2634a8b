"""How many CPU threads to run torch with, decided by measuring.

On a machine shared with other busy processes, torch's OpenMP threads wait at every
barrier for a sibling that the kernel has descheduled: two threads can then be several
times slower than one. The only reliable test is to time both, so the runner times a
small matrix product with each thread count now and then, and keeps the faster.

In a server the runner probes at a step's start, just when the client and the event loop
wake to handle the step's outputs: a few ms of other work. Timings of about a millisecond,
back to back, all fell in that burst, one thread won, and the server ran its next 20 s on
one thread of a quiet machine (84.7% of offline's tok/s under `vllm bench serve`, against
96.0% with two threads fixed). So each timing runs for _WINDOW_S, the two counts' timings
are interleaved over rounds, each keeps its best, and a switch needs a clear win."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

REPROBE_S = 20.0  # seconds between measurements while a run goes on
_ROUNDS = 3  # interleaved timings per thread count; each count keeps its best
_WINDOW_S = 0.010  # each timing runs products for this long: longer than a burst
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
        """Seconds per matrix product the size of one decode step's, on `threads`, over
        _WINDOW_S of them: a burst of other work of a few ms is then a share of the window,
        not all of it (a server's client and event loop wake right after each step)."""
        torch.set_num_threads(threads)
        with torch.inference_mode():
            F.linear(self._a, self._w)  # warm the thread pool
            start = time.perf_counter()
            n, took = 0, 0.0
            while took < _WINDOW_S:
                F.linear(self._a, self._w)
                n += 1
                took = time.perf_counter() - start
            return took / n
