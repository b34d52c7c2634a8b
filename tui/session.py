"""The session: one trace's Timeline, the cursor and what moves it, and frame building.

It is plain synchronous code, driven by the worker thread (tui.worker) and by tests and
benchmarks directly: `handle(command)` changes the cursor or the settings, `tick()` does
the time-driven work (following a growing file, playing, one slice of a long search),
and `frame()` builds the frame for the cursor with the pure reducer in tui.viewmodel.
Only the thread that owns a Session may call it: the Timeline it holds is not shared.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from recorder.errors import TraceError
from recorder.schema import Step
from replays.breakpoints import Predicate, find, parse
from replays.clients import ClientLog
from replays.scan import Digested
from replays.state import State
from replays.timeline import Timeline
from tui.commands import (
    Cancel,
    Command,
    FindBreak,
    FindRequest,
    FollowRequest,
    Goto,
    GotoEdge,
    GotoTime,
    Move,
    SetBreakpoints,
    Speed,
    ToggleBreakpoint,
    TogglePlay,
    WatchIncidents,
)
from tui.history import Digest, Event, History, names_before
from tui.incidents import IncidentFeed
from tui.viewmodel import Context, Frame, StepInput, build_frame
from tui.waits import WaitBook, decoders

if TYPE_CHECKING:  # the session only reads a link; the network code stays in tui.remote
    from tui.remote import Link

SPEEDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)  # steps per second
DEFAULT_SPEED = 10
WINDOW = 160  # steps of sparkline history around the cursor
CATCHUP = 2048  # live: new steps digested one by one (for the log); more: skip ahead
LOG_STEPS = 1024  # steps of events the log looks back over
SLICE = 1024  # steps one slice of a breakpoint search covers before looking at commands
POLL_S = 0.05  # live: how often to look for new records
IDLE_S = 3.0  # live: after this long without a new step, the header says so
CLIENTS_S = 0.5  # live: how often to look for CLIENT records when no step came
MAX_FPS = 30  # playing: frames per second at most
INLINE_FILL = 48  # missing history steps made before a frame; more are made after it
AHEAD = 32  # history steps made past the window's end at a time (stepping forwards)
RATE_STEPS = 16  # tokens per second are averaged over this many steps
SCAN_SHOW_S = 0.5  # the open incidents view gets the scan's progress this often

_REQUEST_KINDS = ("admit", "preempt", "first-token", "finish")
_KIND_WORDS = {
    "admit": "admitted",
    "preempt": "preempted",
    "first-token": "first token",
    "finish": "finished",
}


@dataclass(slots=True)
class _Search:
    """A breakpoint search in progress: it runs a slice per tick."""

    predicates: tuple[Predicate, ...]  # what to stop at
    backward: bool  # towards step 0
    at: int  # searched from here on (exclusive)
    request: str | None  # a followed request's events, rather than the breakpoints


@dataclass(frozen=True, slots=True)
class Writer:
    """The process writing a live trace, so that a view can tell when it has died."""

    pid: int  # its pid
    alive: Callable[[], bool]  # whether it still runs


class Session:
    """One trace being viewed: its Timeline, the cursor, the settings, the history."""

    def __init__(
        self,
        timeline: Timeline,
        *,
        name: str,
        live: bool = False,
        breakpoints: tuple[Predicate, ...] = (),
        clock: Callable[[], float] = time.monotonic,
        history: History | None = None,
        writer: Writer | None = None,
    ) -> None:
        self.tl = timeline
        self.name = name
        self.live = live
        self.following = live  # live: the cursor stays on the newest step
        self.playing = False
        self.speed: float = DEFAULT_SPEED
        self.breakpoints: list[Predicate] = list(breakpoints)
        self.followed: str | None = None
        self.search: _Search | None = None
        self.history = history if history is not None else History()
        self.notes: deque[Event] = deque(maxlen=64)  # breakpoint hits and the like
        self.status = ""  # the newest of them, for the status line (not the event log)
        self.notices: list[tuple[str, str]] = []  # (severity, text) for the UI, once each
        self.dirty = True  # the cursor or a setting changed since the last frame
        self.seq = 0
        self.cursor = timeline.last_step if live else timeline.first_step
        if self.cursor < timeline.first_step:
            self.cursor = timeline.first_step - 1  # no steps yet
        # Live over a stream: a fresh Timeline when the stream skipped ahead (resync) or
        # started again after a reconnect, with why ("resync" or "reconnect").
        self.resync: Callable[[], tuple[Timeline, str] | None] | None = None
        # Live over a stream: how the connection stands (the header shows it, not the file's).
        self.link: Callable[[], Link] | None = None
        self.count_window = ""  # what the counters cover: "since attach" over a stream
        self._link_text = ""  # the link as the last frame said it
        self._clock = clock
        self._grew_at = clock()
        self._idle_shown = 0
        self._played_at = 0.0
        self._carry = 0.0
        self._ended = timeline.finished
        self.writer = writer  # live: the process writing the trace, when its name says
        self.writer_gone = False  # it died without closing the trace
        self._backfill: tuple[int, int] | None = None  # history to make after a jump
        self._step: tuple[int, StepInput] | None = None  # the cursor's step, spelled out
        self._followed_to: int | None = None  # live: the step of the last frame following
        self._before_names: dict[int, str] = {}  # the cursor step's requests, named
        self.clients = _client_log(timeline)  # a server's CLIENT records, if any
        self._clients_at = clock()
        self._before_decoders: tuple[int, ...] = ()  # and its leading decodes
        self.waits = WaitBook()
        self.incidents = IncidentFeed(timeline.reader, live)  # scanned in slices by tick()
        # A simulated run (no model): its clock includes any pacing sleep, and its rate is
        # a scripted model's, so its step time is the engine's own (schedule + update)
        # and no tokens per second are shown.
        self.simulated = timeline.header.model == ""
        self.history.engine_time = self.simulated
        self.history.prefix_caching = caches_prefixes(timeline)
        self.watch_incidents = False  # the incidents view is open: show the scan's progress
        self._scan_shown = 0.0  # when a frame last showed it
        self._say_cut()

    def _say_cut(self) -> None:
        """The notice docs/tui.md promises for a trace whose writer died mid-record."""
        cut, tl = self.tl.cut, self.tl
        if cut is not None:
            self.notices.append(
                (
                    "warning",
                    f"the trace is cut at byte {cut.offset:,} ({cut.reason}): it ends at "
                    f"step {tl.last_step}",
                )
            )

    # -- commands ----------------------------------------------------------------------------

    def close(self) -> None:
        """Close the trace the session shows."""
        self.tl.close()

    def handle(self, cmd: Command) -> None:
        """Apply one command from the UI."""
        if isinstance(cmd, Move | Goto | GotoTime | GotoEdge):
            self._navigate(cmd)
        elif isinstance(cmd, TogglePlay):
            self._toggle_play()
        elif isinstance(cmd, Speed):
            self.speed = _next_speed(self.speed, cmd.faster)
        elif isinstance(cmd, FindBreak):
            self._start_search(tuple(self.breakpoints), cmd.backward, None)
        elif isinstance(cmd, FindRequest):
            preds = tuple(parse(f"{k}:{cmd.request_id}") for k in _REQUEST_KINDS)
            self._start_search(preds, cmd.backward, cmd.request_id)
        elif isinstance(cmd, SetBreakpoints):
            self.breakpoints = list(dict.fromkeys(cmd.predicates))
            self._check_ids()
        elif isinstance(cmd, ToggleBreakpoint):
            if cmd.predicate in self.breakpoints:
                self.breakpoints.remove(cmd.predicate)
            else:
                self.breakpoints.append(cmd.predicate)
        elif isinstance(cmd, FollowRequest):
            self.followed = cmd.request_id
            self.status = (
                f"following {cmd.request_id}: ] / [ go to its next / previous event"
                if cmd.request_id
                else "following no request"
            )
        elif isinstance(cmd, WatchIncidents):
            self.watch_incidents = cmd.on
        elif isinstance(cmd, Cancel):
            self.search = None
            self.playing = False
        else:
            return
        self.dirty = True

    def _check_ids(self) -> None:
        """Drop the breakpoints that name a request the trace does not have, saying so
        (checked again when the incident scan has read the whole trace)."""
        unknown = [
            p
            for p in self.breakpoints
            if p.request is not None and self.incidents.known(p.request) is False
        ]
        for p in unknown:
            self.breakpoints.remove(p)
            self.notices.append(
                ("warning", f"breakpoint {p} refused: no request {p.request!r} in this trace")
            )
        if unknown:
            self.dirty = True

    def _navigate(self, cmd: Move | Goto | GotoTime | GotoEdge) -> None:
        tl = self.tl
        self.status = ""
        self.search = None
        self.playing = False
        self.following = False
        if tl.num_steps == 0:
            return
        if isinstance(cmd, Move):
            target = self.cursor + cmd.delta
        elif isinstance(cmd, Goto):
            target = cmd.step
        elif isinstance(cmd, GotoTime):
            target = tl.step_at_time(cmd.time_ns)
        else:
            target = tl.last_step if cmd.end else tl.first_step
            self.following = cmd.end and self.live
        self.cursor = min(max(target, tl.first_step), tl.last_step)
        if isinstance(cmd, Goto) and cmd.step != self.cursor:
            where = "past the end" if cmd.step > tl.last_step else "before the start"
            edge = "last" if cmd.step > tl.last_step else "first"
            self.status = f"step {cmd.step:,} is {where}: went to the {edge} step, {self.cursor:,}"
            self.notices.append(("information", self.status))

    def _toggle_play(self) -> None:
        self.search = None
        if self.following:
            self.following = False  # pause a live view where it is
        elif self.playing:
            self.playing = False
        elif self.live:
            # A paused live view resumes following the engine, not playing back.
            self.following = True
            self.cursor = self.tl.last_step
        elif self.cursor < self.tl.last_step:
            self.playing = True
            self._played_at = self._clock()
            self._carry = 0.0
        else:
            self.notices.append(("information", "at the last step: nothing to play"))

    def restart(self, timeline: Timeline, why: str = "resync") -> None:
        """Go on with a new Timeline of the same engine that starts later (the stream
        skipped this viewer ahead to a fresh snapshot, or a reconnect started a new
        stream): state from there, following."""
        skipped_from = self.tl.last_step
        self.tl.reader.close()
        self.tl = timeline
        self.clients = _client_log(timeline)  # a resync starts a new spool file
        self.history = History()
        self.history.engine_time = self.simulated
        self.history.prefix_caching = caches_prefixes(timeline)
        self.waits = WaitBook()  # waits before the skip are not in the new timeline
        self.incidents = IncidentFeed(timeline.reader, True)
        self.incidents.window = self.count_window
        self._before_decoders = ()
        self.search = None
        self.playing = False
        self.following = True
        self.cursor = max(timeline.last_step, timeline.first_step - 1)
        self._step = None
        self._backfill = None
        self._followed_to = None
        self._before_names = {}
        self._ended = timeline.finished
        if why != "reconnect":
            text = (
                f"this view fell behind the server: skipped from step {skipped_from:,} "
                f"to step {timeline.first_step:,}"
            )
        elif timeline.first_step > skipped_from + 1:
            text = (
                f"reconnected: steps {skipped_from + 1:,} to {timeline.first_step - 1:,} "
                "were not seen"
            )
        else:  # the server started again: its steps count from the start
            text = f"reconnected to a new run of the server, at step {timeline.first_step:,}"
        self.notes.append(Event(timeline.first_step, "note", text))
        if why == "reconnect":
            self.status = text
        self.dirty = True

    # -- time-driven work --------------------------------------------------------------------

    def timeout(self) -> float | None:
        """How long the worker may wait for a command before calling tick() (None: until
        a command comes)."""
        if self.search is not None or self._backfill is not None:
            return 0.0
        if self.playing:
            return max(1.0 / self.speed, 1.0 / MAX_FPS)
        if self.incidents.busy and not self._scan_attached():
            return 0.0  # the incident scan goes on between commands
        if self.live and not self.tl.finished and not self.writer_gone:
            return POLL_S
        return None

    def tick(self) -> None:
        """Follow the growing file, play, or search one slice."""
        now = self._clock()
        if self.live:
            self._grow(now)
        if self._backfill is not None:
            lo, hi = self._backfill
            self._backfill = None
            self._fill(lo, hi)
            self.dirty = True
        if self.search is not None:
            self._search_slice()
        elif self.playing:
            self._play(now)
        elif self.incidents.busy and not self._scan_attached() and self.incidents.step():
            # The open view shows the scan's progress twice a second, not after every
            # slice: a frame costs far more than a slice.
            done = not self.incidents.busy
            if self.watch_incidents and (done or now - self._scan_shown >= SCAN_SHOW_S):
                self._scan_shown = now
                self.dirty = True
            if done:
                self._check_ids()

    def _grow(self, now: float) -> None:
        if self.resync is not None and (fresh := self.resync()) is not None:
            self.restart(*fresh)
        tl = self.tl
        last = tl.last_step
        grew = tl.refresh()
        if self.clients is not None and (grew or now - self._clients_at >= CLIENTS_S):
            # A server writes CLIENT records between steps, also once it is idle.
            self._clients_at = now
            self.dirty = self.clients.refresh() > 0 or self.dirty
        if grew:
            self.incidents.grew()
            self._grew_at = now
            self._idle_shown = 0
            if self.following:
                self.cursor = tl.last_step
                self._live_break(last)
            self.dirty = True
        if tl.finished != self._ended:
            self._ended = tl.finished
            self.dirty = True
        idle = int(now - self._grew_at)
        if idle >= IDLE_S and not tl.finished and not self.writer_gone:
            self._check_writer()
        if idle >= IDLE_S and idle != self._idle_shown and not tl.finished:
            self._idle_shown = idle
            self.dirty = True
        if self.link is not None:
            link = self.link()
            text = link_text(link, idle)
            if text != self._link_text:
                if not link.connected and not self._link_text.startswith("DISCONNECTED"):
                    said = "; retrying" if link.retrying else ""
                    self.notices.append(("warning", f"{self.name}: {link.error}{said}"))
                self._link_text = text
                self.dirty = True

    def _scan_attached(self) -> bool:
        """Following a live trace with the incident scans caught up with the frames:
        the next frame's walk over the new steps hands them their records (_seen), so
        the scans need not read the file by themselves (each record would be decoded
        and replayed two more times). A view that fell behind (skipped ahead) or
        paused leaves the scans to read on by themselves, as in a replay; so does one
        with no new step to show (what is left to scan is not a step: the end record)."""
        return (
            self.following
            and self._followed_to is not None
            and self.incidents.scanned_to >= self._followed_to
            and self.tl.last_step > self._followed_to
        )

    def _seen(self, rec: Step, d: Digest, after: State) -> None:
        """A step the history has just digested: hand it to the incident scans."""
        self.incidents.take(
            Digested(rec, self.tl.offset(rec.step), d.unscheduled, after, self._private)
        )

    def _private(self, step: int) -> State:
        return self.tl.state(step).copy()

    def _check_writer(self) -> None:
        """A quiet live trace whose writer has died will not grow again: read it to its
        end as a finished file would be (which finds a record cut in half), and say so."""
        w = self.writer
        if w is None or w.alive():
            return
        self.writer_gone = True
        tl = self.tl
        tl.live = False
        tl.refresh()
        self.dirty = True
        self.status = f"the writer (pid {w.pid}) is gone: the trace ends at step {tl.last_step}"
        self.notices.append(("warning", self.status))
        self._say_cut()

    def _live_break(self, last: int) -> None:
        """Following a live trace: stop at the first breakpoint hit among the new steps
        (after `last`), and say that the view has paused there."""
        if not self.breakpoints or last < self.tl.first_step - 1:
            return
        hit = find(self.tl, self.breakpoints, last, limit=self.tl.last_step)
        if hit is None:
            return
        self._land(hit, tuple(self.breakpoints), None)
        self.notices.append(
            ("warning", f"live view paused at a breakpoint hit, step {hit}: F follows again")
        )

    def _play(self, now: float) -> None:
        tl = self.tl
        due = (now - self._played_at) * self.speed + self._carry
        steps = int(due)
        if steps < 1:
            return
        steps = min(steps, max(1, int(self.speed)))  # a stalled worker does not leap
        self._carry = due - int(due)
        self._played_at = now
        target = min(self.cursor + steps, tl.last_step)
        hit = find(tl, self.breakpoints, self.cursor, limit=target) if self.breakpoints else None
        if hit is not None:
            self.playing = False
            self._land(hit, tuple(self.breakpoints), None)
            return
        self.cursor = target
        self.dirty = True
        if target >= tl.last_step:
            self.playing = False
            self.following = self.live

    def _start_search(
        self, preds: tuple[Predicate, ...], backward: bool, request: str | None
    ) -> None:
        self.playing = False
        if not preds:
            self.notices.append(
                ("warning", "no breakpoints: press b to break on preemptions, B for others")
            )
            return
        self.following = False
        self.search = _Search(preds, backward, self.cursor, request)
        self._search_slice()  # a short trace is done at once

    def _search_slice(self) -> None:
        search, tl = self.search, self.tl
        assert search is not None
        if search.backward:
            limit = max(search.at - SLICE, tl.first_step)
            hit = find(tl, search.predicates, search.at, backward=True, limit=limit)
            done = limit <= tl.first_step
        else:
            limit = min(search.at + SLICE, tl.last_step)
            hit = find(tl, search.predicates, search.at, limit=limit)
            done = limit >= tl.last_step
        self.dirty = True
        if hit is not None:
            self.search = None
            self._land(hit, search.predicates, search.request)
        elif done:
            self.search = None
            what = (
                f"no {'earlier' if search.backward else 'later'} event of {search.request}"
                if search.request
                else f"no breakpoint hit {'before' if search.backward else 'after'} step "
                f"{self.cursor}"
            )
            self.notices.append(("information", what))
        else:
            search.at = limit

    def _land(self, step: int, preds: tuple[Predicate, ...], request: str | None) -> None:
        """Stop at a search's hit, and say which predicates hold there."""
        self.cursor = step
        self.following = False
        self.dirty = True
        held = [p for p in preds if find(self.tl, [p], step - 1, limit=step) == step]
        if request is not None:
            words = ", ".join(_KIND_WORDS[p.kind] for p in held) or "an event"
            self._note(Event(step, "break", f"{request}: {words} (step {step})", (request,)))
        else:
            names = ", ".join(str(p) for p in held or preds)
            self._note(Event(step, "break", f"breakpoint hit at step {step}: {names}"))

    def _note(self, event: Event) -> None:
        self.notes.append(event)
        self.status = event.text

    # -- frames ----------------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        if self.search is not None:
            return "SEARCHING"
        if self.playing:
            return "PLAYING"
        return "LIVE" if self.following else "PAUSED"

    def window(self, step: int) -> tuple[int, int]:
        """The steps of sparkline history shown around `step`: before it when following a
        live trace, centred on it otherwise."""
        tl = self.tl
        if self.following:
            return step - WINDOW + 1, step
        lo = step - WINDOW // 2
        hi = lo + WINDOW - 1
        if hi > tl.last_step:
            lo -= hi - tl.last_step
            hi = tl.last_step
        if lo < tl.first_step:
            hi = min(hi + tl.first_step - lo, tl.last_step)
            lo = tl.first_step
        return lo, hi

    def frame(self) -> Frame:
        """The frame for the cursor (raises TraceError when the trace cannot be read
        there; the cursor then stays where it was asked to go).

        The sparklines' window is filled here when that takes a few steps (the cursor
        moved a little, or a live trace grew a little); after a jump it is left to the
        next tick(), so that the frame for the new step comes first and its history a
        frame later."""
        tl, i = self.tl, self.cursor
        lo, hi = self.window(i)
        if i >= tl.first_step and self.following and self._followed_to is not None:
            # Every step since the last frame (up to CATCHUP of them), for the log. The
            # working state is at that frame's step: walking on costs one apply a step,
            # and the last step is digested from its view, never by stepping back.
            first = max(min(lo, self._followed_to + 1), i - CATCHUP + 1, tl.first_step)
            skipped = first - self._followed_to - 1
            if skipped > 0:
                self._note(
                    Event(
                        first,
                        "note",
                        f"{skipped:,} steps not read: the "
                        "engine writes faster than this view "
                        "reads",
                    )
                )
            # Keyframes for the last few steps only: a step back from the newest is cheap,
            # and a batch of hundreds of steps is not copied every few dozen.
            self.history.fill(tl, first, i - 1, self._seen, i - 2 * tl.keyframe_interval)
            step = self._step_input(i)
            self.history.add_step(tl, i, self._before_names, self._before_decoders, self._seen)
        else:
            if i >= tl.first_step:
                first = max(lo, tl.first_step)
                if self.history.missing(first, min(hi, tl.last_step)) <= INLINE_FILL:
                    self._fill(first, hi)
                else:
                    self._backfill = (first, hi)
            step = self._step_input(i)
            if step is not None:
                # The step's own events and waits come with its first frame; the
                # history around it may come a frame later.
                self.history.add_step(tl, i, self._before_names, self._before_decoders, self._seen)
        self._followed_to = i if self.following else None
        state = tl.state(i)
        self.seq += 1
        self.dirty = False
        step_ns, rate = self._rates(i)
        http, client = self._client_lines(i)
        ctx = Context(
            seq=self.seq,
            trace=self.name,
            first_step=tl.first_step,
            last_step=tl.last_step,
            max_num_seqs=_int(tl.header.config.get("max_num_seqs")),
            mode=self.mode,
            speed=self.speed,
            breakpoints=tuple(str(p) for p in self.breakpoints),
            followed=self.followed,
            live=self.live,
            ended=tl.finished or self.writer_gone,
            idle_s=self._idle_shown or None,
            search_at=None if self.search is None else self.search.at,
            step_ns=step_ns,
            tokens_per_s=rate,
            http=http,
            client=client,
            status=self.status,
            priority_policy=tl.header.config.get("policy") == "priority",
            link=self._link_text,
            window=self.count_window,
        )
        frame = build_frame(
            state,
            step,
            self.history.window(lo, hi),
            self.history.recent(i, LOG_STEPS),
            (),  # the session's notes go to the status line, not the trace's events
            ctx,
            self.waits.at(i, self.history.get) if i >= tl.first_step else None,
        )
        return replace(frame, incidents=self.incidents.view(tl.last_step))

    def _client_lines(self, i: int) -> tuple[str, str]:
        """A server's HTTP summary by step i, and the followed request's client timings."""
        log = self.clients
        if log is None:
            return "", ""
        followed = log.timings(self.followed, i) if self.followed else ""
        return log.summary(i), followed

    def _fill(self, lo: int, hi: int) -> None:
        """Digest steps lo..hi, and the next AHEAD too when hi is past what is known
        (stepping forwards then finds them made)."""
        ahead = AHEAD if self.history.get(hi) is None and not self.following else 0
        self.history.fill(self.tl, lo, hi + ahead, self._seen)

    def _step_input(self, i: int) -> StepInput | None:
        """Step i spelled out (kept while the cursor stays there)."""
        tl = self.tl
        if i < tl.first_step:
            return None
        if self._step is not None and self._step[0] == i:
            return self._step[1]
        rec: Step = tl.record(i)
        before = tl.state(i - 1)
        reqs = before.requests
        gone = tuple(reqs[f.ref].copy() for f in rec.finishes if f.ref in reqs)
        self._before_names = names_before(rec, before)
        self._before_decoders = decoders(rec, before)
        step = StepInput(tl.view(i), gone)
        self._step = (i, step)
        return step

    def _rates(self, i: int) -> tuple[int, float | None]:
        """How long step i took, and scheduled tokens per second over the RATE_STEPS
        steps up to it: from the step records alone."""
        tl = self.tl
        if i < tl.first_step:
            return 0, None
        if self.simulated:
            rec = tl.record(i)
            return rec.schedule_ns + rec.update_ns, None
        rec = tl.record(i)
        end = rec.time_ns
        # the step's work, not the wait before it (Step.duration_ns; docs/metrics.md)
        step_ns = rec.duration_ns(tl.record(i - 1).time_ns if i > tl.first_step else 0)
        lo = max(tl.first_step, i - RATE_STEPS)
        if lo == i:
            return max(0, step_ns), None
        tokens = sum(tl.record(s).num_scheduled_tokens for s in range(lo + 1, i + 1))
        elapsed = end - tl.record(lo).time_ns
        return max(0, step_ns), (tokens / (elapsed / 1e9) if elapsed > 0 and tokens else None)


def caches_prefixes(timeline: Timeline) -> bool:
    """Whether the run caches prefixes (vLLM's default: on), so an admission without a
    hit is a miss worth saying."""
    return timeline.header.config.get("enable_prefix_caching", True) is not False


def link_text(link: Link, idle_s: int) -> str:
    """The header's word for a server connection: CONNECTED, IDLE 12s (connected, no
    step for IDLE_S or more: a quiet server is not a gone one), DISCONNECTED (retrying)."""
    if not link.connected:
        return "DISCONNECTED (retrying)" if link.retrying else "DISCONNECTED"
    return f"IDLE {idle_s}s" if idle_s >= IDLE_S else "CONNECTED"


def _client_log(timeline: Timeline) -> ClientLog | None:
    """The CLIENT records of the timeline's trace file (None when it has none to read)."""
    path = getattr(timeline.reader, "path", None)
    if not isinstance(path, Path) or not path.exists():
        return None
    log = ClientLog(path)
    try:
        log.refresh()
    except (TraceError, OSError):
        return None
    return log


def _next_speed(speed: float, faster: bool) -> float:
    if faster:
        return float(next((s for s in SPEEDS if s > speed), SPEEDS[-1]))
    return float(next((s for s in reversed(SPEEDS) if s < speed), SPEEDS[0]))


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
