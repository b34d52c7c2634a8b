"""The walk the incident scans share: a trace's frames from where the last slice stopped,
a slice of step records at a time, over a file that may still grow.

`replays.storms.IncidentScan` and `replays.queueing.QueueScan` read the same trace in the
same slices (the TUI runs both between its other work). What they do with a record
differs; where they are in the file, how a slice ends, and how a step another walk has
already decoded is handed over (`take`) without being read again, do not: that is here,
once, so the two cannot disagree on which records a slice covered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from recorder.framing import FRAME_SIZE
from recorder.reader import TraceReader
from recorder.schema import Step
from replays.state import State


@dataclass(slots=True)  # not frozen: one per step a live view follows (frozen init costs 4x)
class Digested:
    """A step record as another walk of the same trace (the TUI session's) has decoded
    and applied it, for a scan that has got just that far to count without reading it."""

    rec: Step
    offset: int  # where the record starts in the file
    left: tuple[tuple[int, int], ...]  # (ref, reason) of its unscheduled requests
    after: State  # the state after it (read at once, not kept)
    resume: Callable[[int], State]  # a private copy of the state after a step, to read on


class RecordScan:
    """Walks a trace's records from the start, a slice at a time (`advance`); a subclass
    says what a record means to it (`_record`). Over a file still being written (`tail`),
    a later `advance` picks up the records appended since."""

    def __init__(self, reader: TraceReader, tail: bool = False) -> None:
        self.reader = reader
        self.tail = tail
        self.offset = reader.records_start  # where the next record starts
        self.last_step = reader.header.first_step - 1  # the last step counted
        self._skip = -1  # the offset of a step record take() was given already

    def advance(self, max_steps: int | None = None) -> int:
        """Scan up to `max_steps` more step records (None: to the end); how many it
        counted. Raises TraceError for a record that cannot be read."""
        n = 0
        for offset, rtype, body in self.reader.frames(self.offset, tail=self.tail):
            if max_steps is not None and n >= max_steps:
                break
            self.offset = offset + FRAME_SIZE + len(body)
            if offset == self._skip:
                continue  # taken already
            n += self._record(offset, rtype, body)
        return n

    def _record(self, offset: int, rtype: int, body: bytes) -> bool:
        """Read one record (not taken already); whether it was a step counted."""
        raise NotImplementedError

    def _next(self, d: Digested) -> bool:
        """Whether `d` is the next step this scan would read."""
        return d.rec.step == self.last_step + 1 and d.offset >= self.offset

    def _taken(self, d: Digested) -> None:
        """Count `d` as read: no step record lies between self.offset and its offset
        (steps are in order and the last one counted was d.rec.step - 1), only records
        the scan would skip, so reading resumes there and passes over `d` itself."""
        self.offset = self._skip = d.offset
