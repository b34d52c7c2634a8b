"""Pacing a simulation to watch it: the simulated model runs thousands of steps a second."""

from __future__ import annotations

import time
from typing import Any

MIN_PACE, MAX_PACE = 0.01, 1e6  # steps/s: slower is a step per 100 s; 1e-300 overflowed sleep()


class Pace:
    """An engine event sink that sleeps between steps, so that a live viewer can follow
    (the recorder, an earlier sink, has written each step before this one sleeps)."""

    def __init__(self, steps_per_s: float) -> None:
        if not MIN_PACE <= steps_per_s <= MAX_PACE:
            raise ValueError(f"{steps_per_s:g}: must be 0 or in [{MIN_PACE:g}, {MAX_PACE:g}]")
        self.interval = 1.0 / steps_per_s  # seconds between steps
        self.due: float | None = None  # when the next step may start (monotonic clock)

    def on_step(self, report: Any) -> None:
        now = time.monotonic()
        self.due = now if self.due is None else max(self.due, now - self.interval)
        self.due += self.interval
        time.sleep(max(0.0, self.due - now))

    def close(self) -> None:
        pass
