"""Where the engine sends its step reports. The default sink does nothing, so an engine
without an observer pays nothing; the recorder is one such observer, unknown to the engine."""

from __future__ import annotations

from typing import Protocol

from engine.report import StepReport


class EventSink(Protocol):
    """Receives one StepReport per engine step, in step order."""

    def on_step(self, report: StepReport) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """The default sink: drops everything."""

    def on_step(self, report: StepReport) -> None:
        pass

    def close(self) -> None:
        pass


NULL_SINK = NullSink()
