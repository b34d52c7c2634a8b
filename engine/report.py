"""What every step reports: the step record of engine.records, which the engine fills in
and hands to its event sink. Everything the recorder needs to rebuild the engine's state
without an engine is there; the names below are re-exported for the engine's callers."""

from __future__ import annotations

from engine.records import (
    Admission,
    Arrival,
    Finish,
    Kind,
    Preemption,
    QueueStop,
    Reason,
    Scheduled,
    Shortfall,
    SpecAccepted,
    Step,
)

__all__ = [
    "Admission",
    "Arrival",
    "Finish",
    "Kind",
    "Preemption",
    "QueueStop",
    "Reason",
    "Scheduled",
    "Shortfall",
    "SpecAccepted",
    "Step",
]
