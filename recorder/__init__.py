"""The flight recorder: turns engine step reports into a crash-safe msgpack trace.

Reading a trace needs none of the engine: `recorder.schema`, `recorder.reader` and
`recorder.errors` import nothing from it. `Recorder` and `open_recording` (which wrap an
engine) are imported lazily, so `import recorder` stays engine-free too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from recorder.errors import RecordingError, TraceError
from recorder.reader import Cut, Entry, TraceIndex, TraceReader

if TYPE_CHECKING:
    from recorder.recorder import Recorder, open_recording

__all__ = [
    "Cut",
    "Entry",
    "Recorder",
    "RecordingError",
    "TraceError",
    "TraceIndex",
    "TraceReader",
    "open_recording",
]


def __getattr__(name: str) -> Any:
    if name in ("Recorder", "open_recording"):
        from recorder import recorder as module

        return getattr(module, name)
    raise AttributeError(f"module 'recorder' has no attribute {name!r}")
