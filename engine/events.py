"""Where the engine sends its step reports. The default sink does nothing, so an engine
without an observer pays nothing; the recorder is one such observer, unknown to the engine.

A server in front of the engine also sees what the engine cannot: when a client's HTTP
request arrived, when its tokens were sent, whether it went away, which requests were
refused with a 4xx/5xx. It reports that through the same sink (`on_client`), from the
engine's thread, between two steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.report import Step


@dataclass(frozen=True, slots=True)
class ClientReport:
    """One HTTP request as the server saw it, sent when its response ended."""

    request_id: str  # the engine's request id; "" when it never reached the engine
    endpoint: str  # the route, e.g. "/v1/completions"
    status: int  # HTTP status code of the response
    finish_reason: str  # "stop", "length", "abort" (client left), "error"; "" if refused
    stream: bool  # server-sent events rather than one JSON body
    prompt_tokens: int  # prompt length (0 when refused before tokenizing)
    completion_tokens: int  # output tokens generated for it
    queue_s: float | None  # HTTP request received -> first scheduled (None: never)
    ttft_s: float | None  # HTTP request received -> first token sent (None: none sent)
    e2e_s: float  # HTTP request received -> response ended
    itl_s: tuple[float, ...] = ()  # gaps between consecutive token chunks sent
    message: str = ""  # for a 4xx/5xx: what was wrong


class EventSink(Protocol):
    """Receives one Step record per engine step, in step order."""

    def on_step(self, report: Step) -> None: ...

    def close(self) -> None: ...


def report_client(sink: object, report: ClientReport) -> None:
    """Hand a ClientReport to `sink` if it takes them (`on_client`); sinks written before
    servers existed simply do not see them."""
    on_client = getattr(sink, "on_client", None)
    if on_client is not None:
        on_client(report)


class NullSink:
    """The default sink: drops everything."""

    def on_step(self, report: Step) -> None:
        pass

    def on_client(self, report: ClientReport) -> None:
        pass

    def close(self) -> None:
        pass


NULL_SINK = NullSink()
