"""What the UI thread asks of the worker: small immutable commands, sent down a queue.

The UI never touches the Timeline; it says where to go and receives frames back.
"""

from __future__ import annotations

from dataclasses import dataclass

from replays.breakpoints import Predicate


@dataclass(frozen=True, slots=True)
class Move:
    """Step forwards (delta > 0) or backwards by `delta` steps."""

    delta: int  # steps to move


@dataclass(frozen=True, slots=True)
class Goto:
    """Go to a step (clamped to the trace)."""

    step: int  # the step to show


@dataclass(frozen=True, slots=True)
class GotoTime:
    """Go to the last step that ended at or before a time."""

    time_ns: int  # ns since the recording started


@dataclass(frozen=True, slots=True)
class GotoEdge:
    """Go to the first or the last step; in live mode the last step means following."""

    end: bool  # True: the last step


@dataclass(frozen=True, slots=True)
class TogglePlay:
    """Play or pause (in live mode, pausing stops following the newest step)."""


@dataclass(frozen=True, slots=True)
class Speed:
    """Play faster or slower, along a fixed ladder of speeds."""

    faster: bool  # up the ladder


@dataclass(frozen=True, slots=True)
class FindBreak:
    """Go to the next (or previous) step where a breakpoint holds."""

    backward: bool  # search towards step 0


@dataclass(frozen=True, slots=True)
class FindRequest:
    """Go to the next (or previous) event of a request: admission, preemption, first
    token or finish."""

    request_id: str  # the request
    backward: bool  # search towards step 0


@dataclass(frozen=True, slots=True)
class SetBreakpoints:
    """Replace the breakpoints."""

    predicates: tuple[Predicate, ...]  # parsed by replays.breakpoints.parse


@dataclass(frozen=True, slots=True)
class ToggleBreakpoint:
    """Add a breakpoint, or remove it if it is set."""

    predicate: Predicate  # the breakpoint


@dataclass(frozen=True, slots=True)
class FollowRequest:
    """Follow a request (it is named in the header and its events can be jumped to)."""

    request_id: str | None  # None: follow none


@dataclass(frozen=True, slots=True)
class WatchIncidents:
    """The incidents view opened or closed: while it is open, each slice of the incident
    scan makes a new frame."""

    on: bool  # the view is open


@dataclass(frozen=True, slots=True)
class Cancel:
    """Stop a running search, or playing."""


@dataclass(frozen=True, slots=True)
class FrameTaken:
    """The UI has taken the last frame: the worker may build the next one."""


@dataclass(frozen=True, slots=True)
class Stop:
    """End the worker."""


Command = (
    Move
    | Goto
    | GotoTime
    | GotoEdge
    | TogglePlay
    | Speed
    | FindBreak
    | FindRequest
    | SetBreakpoints
    | ToggleBreakpoint
    | FollowRequest
    | WatchIncidents
    | Cancel
    | FrameTaken
    | Stop
)
