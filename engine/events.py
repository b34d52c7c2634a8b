"""Where the engine sends its step reports. The default sink does nothing, so an engine
without an observer pays nothing; the recorder is one such observer, unknown to the engine.

A server in front of the engine also sees what the engine cannot: when a client's HTTP
request arrived, when its tokens were sent, whether it went away, which requests were
refused with a 4xx/5xx. It reports that through the same sink (`on_client`, a Client
record as the trace holds it), from the engine's thread, between two steps."""

from __future__ import annotations

from typing import Protocol

from engine.records import Client, Step


class EventSink(Protocol):
    """Receives one Step record per engine step, in step order."""

    def on_step(self, report: Step) -> None: ...

    def close(self) -> None: ...


def report_client(sink: object, report: Client) -> None:
    """Hand a Client to `sink` if it takes them (`on_client`); sinks written before
    servers existed simply do not see them."""
    on_client = getattr(sink, "on_client", None)
    if on_client is not None:
        on_client(report)


class NullSink:
    """The default sink: drops everything."""

    def on_step(self, report: Step) -> None:
        pass

    def on_client(self, report: Client) -> None:
        pass

    def close(self) -> None:
        pass


NULL_SINK = NullSink()
