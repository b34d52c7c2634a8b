"""What the server needs from a flight recorder. The engine never imports the recorder:
the `serve` command builds one and hands it over as an object of these shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


class StreamSubscription(Protocol):
    """One live viewer's feed of trace bytes."""

    def get(self, timeout: float) -> bytes | None:
        """The next chunk (trace bytes in the trace's own framing); None on timeout;
        b"" once the stream has ended."""
        ...

    def close(self) -> None: ...


class ServerRecording(Protocol):
    """A recording the engine thread keeps up to date; it is the engine core's sink."""

    def on_idle(self) -> None:
        """Called from the engine thread when it has no work, at least every 100 ms."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LiveRecording(Protocol):
    """A recording that also serves live viewers and cuts incident traces."""

    directory: Path  # this server run's segment directory

    def on_idle(self) -> None: ...

    def subscribe(self) -> StreamSubscription:
        """Thread-safe, from the HTTP side."""
        ...

    def incident(self, window_s: float, note: str | None) -> Path:
        """Thread-safe: the trace file covering the last `window_s` seconds."""
        ...

    def close(self) -> None: ...
