"""The reader thread: it owns the Session (and so the Timeline and the file), takes
commands from the UI thread, and hands back frames.

Frames are coalesced: the worker keeps only the newest one and builds the next only once
the UI has taken the last (FrameTaken), so a fast engine or fast keys never queue up
frames, and a slow terminal sees the newest state rather than a backlog. The worker knows
nothing of Textual: it reports through two callbacks, which the app turns into messages.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from recorder.errors import TraceError
from tui.commands import Command, FrameTaken, Stop
from tui.session import Session
from tui.viewmodel import Frame

FRAME_S = 1 / 20  # frames made due by time alone (a growing trace, playing) come this far
# apart at least: drawing more often only takes time from reading. Keys are shown at once.
BUSY_FRAME_S = 1 / 10  # ... and this far when building one took BUSY_SHARE of that or more
BUSY_SHARE = 0.5
Notify = Callable[[str, str], None]  # (severity, text): "information", "warning" or "error"


class FrameSource:
    """Runs a Session in a thread of its own (`run`, the thread's body) and hands its
    frames to one consumer. `send` and `take` are the only calls another thread makes."""

    def __init__(self, session: Session, on_frame: Callable[[], None], on_notice: Notify) -> None:
        self.session = session
        self._on_frame = on_frame  # called (from the worker thread) when a frame is ready
        self._on_notice = on_notice
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._frame: Frame | None = None  # the newest frame, not yet taken
        self._pending = False  # a frame was announced and not taken yet
        self._good = session.cursor  # the last step a frame was built for

    # -- the UI thread's side -------------------------------------------------------------

    def send(self, cmd: Command) -> None:
        """Queue a command for the worker."""
        self._commands.put(cmd)

    def take(self) -> Frame | None:
        """The newest frame (None if it was taken already); lets the worker build the next."""
        with self._lock:
            frame, self._frame = self._frame, None
        self._commands.put(FrameTaken())
        return frame

    def stop(self) -> None:
        self._commands.put(Stop())

    # -- the worker thread's side -----------------------------------------------------------

    def run(self) -> None:
        """The worker thread's loop: wait for a command or the session's next tick, apply,
        tick, and publish a frame when one is due and the last one was taken."""
        session = self.session
        urgent = True  # the user asked for something: show it now
        next_frame = 0.0  # frames that only time made due wait until then
        while True:
            self._guard(session.tick)
            wait: float | None = None
            if session.dirty and not self._pending:
                now = time.monotonic()
                if urgent or now >= next_frame:
                    self._publish()
                    urgent = False
                    next_frame = now + frame_spacing(time.monotonic() - now)
                else:
                    wait = next_frame - now
            self._flush_notices()
            timeout = session.timeout()
            if wait is not None:
                timeout = wait if timeout is None else min(timeout, wait)
            for cmd in self._next_commands(timeout):
                if isinstance(cmd, Stop):
                    return
                if isinstance(cmd, FrameTaken):
                    self._pending = False
                else:
                    urgent = True
                    self._guard(session.handle, cmd)

    def run_once(self) -> Frame | None:
        """Apply the queued commands, tick and build a frame if one is due, without
        waiting (tests and benchmarks drive the source with this, with no thread)."""
        session = self.session
        for cmd in self._next_commands(0.0):
            if isinstance(cmd, FrameTaken):
                self._pending = False
            elif not isinstance(cmd, Stop):
                self._guard(session.handle, cmd)
        self._guard(session.tick)
        frame = None
        if session.dirty:
            self._publish()
            frame = self.take()
            self._next_commands(0.0)  # that FrameTaken
            self._pending = False
        self._flush_notices()
        return frame

    def _next_commands(self, timeout: float | None) -> list[Command]:
        """Every queued command, waiting up to `timeout` for the first (None: forever)."""
        try:
            first = (
                self._commands.get_nowait() if timeout == 0 else self._commands.get(timeout=timeout)
            )
        except queue.Empty:
            return []
        out = [first]
        while True:
            try:
                out.append(self._commands.get_nowait())
            except queue.Empty:
                return out

    def _publish(self) -> None:
        session = self.session
        try:
            frame = session.frame()
        except Exception as e:
            # The trace cannot be read at the cursor: say so and go back to the last step
            # that could be shown.
            self._report(e)
            session.cursor = self._good
            session.dirty = False
            session.playing = False
            session.search = None
            return
        self._good = frame.header.step
        with self._lock:
            self._frame = frame
        self._pending = True
        self._on_frame()

    def _guard(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.session.playing = False
            self.session.search = None
            self._report(e)

    def _report(self, e: Exception) -> None:
        text = str(e) if isinstance(e, TraceError) else f"{type(e).__name__}: {e}"
        self._on_notice("error", text)

    def _flush_notices(self) -> None:
        notices, self.session.notices = self.session.notices, []
        for severity, text in notices:
            self._on_notice(severity, text)


def frame_spacing(built_s: float) -> float:
    """How long after a frame the next one that time alone makes due may come, given
    that building this one took `built_s` (mostly digesting the steps a live engine
    wrote since the frame before). A reader that spends half the time between frames
    on them is falling behind or close to it: the drawing, which shares the
    interpreter with it, then comes half as often, so that reading gets the time."""
    return BUSY_FRAME_S if built_s >= BUSY_SHARE * FRAME_S else FRAME_S
