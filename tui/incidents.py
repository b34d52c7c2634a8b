"""The incidents list as the reader thread keeps it: a scan of the whole trace, run a
slice at a time between the session's other work, so that the incidents view opens at
once whatever the trace's length (it shows how far the scan has got until it is done)."""

from __future__ import annotations

from dataclasses import dataclass

from recorder.errors import TraceError
from recorder.ids import client_id
from recorder.reader import TraceReader
from replays.queueing import CacheLoss, HeadOfLine, QueueScan, QueueWait
from replays.scan import Digested
from replays.storms import Incident, IncidentScan, StormSummary

SCAN_SLICE = 1024  # step records scanned per tick (tens of ms) before commands are read
QUEUE_SLICE = 256  # step records replayed for the waits per tick


@dataclass(frozen=True, slots=True)
class IncidentsVM:
    """What the incidents view shows."""

    items: tuple[Incident, ...]  # every incident found so far, in step order
    summary: StormSummary  # the storm in numbers, over the steps scanned
    scanned_to: int  # the last step scanned
    last_step: int  # the trace's last step known to the session
    done: bool  # the scan has reached the end of the trace (for now, when live)
    error: str  # why the scan stopped early ("" when it did not)
    window: str = ""  # what the counts cover when not the whole run ("since attach")
    waits: tuple[QueueWait, ...] = ()  # the longest waits before admission, longest first
    head_of_line: tuple[HeadOfLine, ...] = ()  # head-of-line blockings, longest first
    cache_losses: tuple[CacheLoss, ...] = ()  # shared prefixes the cache lost, most first


class IncidentFeed:
    """Runs an IncidentScan in slices and hands out immutable views of what it found."""

    def __init__(self, reader: TraceReader, live: bool) -> None:
        self._scan = IncidentScan(reader, tail=live)
        self._queues = QueueScan(reader, tail=live)  # waits: the same slices, replayed
        self._live = live
        self._caught_up = False  # the last slice reached the end of what is written
        self._error = ""
        self._vm: IncidentsVM | None = None
        self._seen = (-1, -1, -1)  # (incidents, last steps) the cached view was made for
        self.window = ""  # what the scan covers when not the whole run ("since attach")

    @property
    def busy(self) -> bool:
        """There is more to scan right now."""
        return not self._caught_up and not self._error

    def grew(self) -> None:
        """The trace grew: scan its new records too."""
        if not self._scan.done:
            self._caught_up = False

    def step(self) -> bool:
        """Scan one slice; whether anything new was found."""
        if not self.busy:
            return False
        before = len(self._scan.incidents)
        try:
            n = self._scan.advance(SCAN_SLICE)
            # The waits replay the queues: slower per step, so a slice of its own size.
            q = self._queues.advance(QUEUE_SLICE)
        except (TraceError, OSError) as e:
            # Said once, in the view; the scan does not start again (the trace is bad).
            self._error = f"the scan stopped: {e}"
            return True
        if n < SCAN_SLICE and q < QUEUE_SLICE:
            self._caught_up = True
        return len(self._scan.incidents) != before or q > 0 or self._caught_up

    @property
    def scanned_to(self) -> int:
        """The last step both scans have counted."""
        return min(self._scan.last_step, self._queues.last_step)

    def take(self, d: Digested) -> None:
        """Step `d` as the session's walk decoded and applied it, for the scans that have
        got just that far: following a live trace, each new record is then decoded and
        applied once, not three times."""
        if self._error:
            return
        took = self._scan.take(d)
        took = self._queues.take(d) and took
        if took:
            # Caught up with what the session has digested; grew() says when there is
            # more (until then the scans have nothing to read by themselves).
            self._caught_up = True

    def known(self, request_id: str) -> bool | None:
        """Whether the trace has a request `request_id`: None while the scan has not
        seen the whole trace and has not met it yet."""
        if request_id in self._scan.ids or any(client_id(i) == request_id for i in self._scan.ids):
            return True
        return False if self._caught_up and (self._scan.done or not self._live) else None

    def view(self, last_step: int) -> IncidentsVM:
        s = self._scan
        key = (len(s.incidents), s.last_step, self._queues.last_step)
        if self._vm is None or key != self._seen or self._vm.last_step != last_step:
            self._seen = key
            self._vm = IncidentsVM(
                tuple(s.incidents),
                s.summary(),
                min(s.last_step, self._queues.last_step),
                last_step,
                self._caught_up,
                self._error,
                self.window,
                self._queues.waits(),
                self._queues.head_of_line(),
                self._queues.cache_losses(),
            )
        return self._vm
