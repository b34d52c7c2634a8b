"""The schedtop app: the main screen, its keys, and the wiring between the panes and the
reader thread.

Data flows one way. The reader thread (tui.worker) owns the Session and the Timeline and
posts FrameReady; the app takes the frame (immutable) and hands each pane its part as
attributes. The panes report what the user picks as messages; keys become commands sent
to the reader thread. Nothing here reads the trace or the clock.
"""

from __future__ import annotations

import gc
import threading
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Input
from textual.worker import get_current_worker

from replays.breakpoints import Predicate, parse
from replays.storms import Incident
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
from tui.format import duration, short_id
from tui.screens.help import HelpScreen
from tui.screens.incidents import IncidentsScreen
from tui.screens.prompt import breakpoints_screen, goto_screen
from tui.session import Session
from tui.viewmodel import NUMERIC_SORTS, SORT_KEYS, Frame, table_rows
from tui.widgets.batch import BatchBar
from tui.widgets.blockmap import ZOOMS, BlockMap
from tui.widgets.detail import BlockDetail
from tui.widgets.events import EventLog
from tui.widgets.fix import FixState
from tui.widgets.header import StepHeader
from tui.widgets.lines import StepClicked
from tui.widgets.requests import RequestTable
from tui.widgets.sparks import Sparklines
from tui.widgets.status import StatusLine
from tui.worker import FrameSource

PREEMPT = parse("preempt")
SHORT = 30  # terminal lines under which the middle panes shrink for the requests
GC_THRESHOLD = 20_000  # allocations between young-generation collections (default 700)
W = TypeVar("W", bound=Widget)


class FrameReady(Message):
    """The reader thread has a new frame."""


class Notice(Message):
    """The reader thread has something to say."""

    def __init__(self, severity: str, text: str) -> None:
        super().__init__()
        self.severity = severity
        self.text = text


class SchedtopApp(App[None]):
    """Live view and replay debugger of one trace."""

    CSS_PATH = "app.tcss"
    TITLE = "schedtop"
    ENABLE_COMMAND_PALETTE = False
    # A maximized pane keeps the header and the status line: the step it shows, and keys.
    ALLOW_IN_MAXIMIZED_VIEW = "StepHeader, StatusLine"

    BINDINGS = [
        Binding("space", "play", "play/pause"),
        Binding("right", "move(1)", "step"),
        Binding("left", "move(-1)", "back", show=False),
        Binding("shift+right", "move(10)", "10 steps", show=False),
        Binding("shift+left", "move(-10)", "10 back", show=False),
        Binding("home", "edge(False)", "first step", show=False),
        Binding("end,F,G", "edge(True)", "last/follow", show=False),
        Binding("plus,equals_sign", "speed(True)", "faster", show=False),
        Binding("minus", "speed(False)", "slower", show=False),
        Binding("g", "goto", "go to"),
        Binding("n", "find(False)", "next break"),
        Binding("N", "find(True)", "prev break", show=False),
        Binding("b", "toggle_preempt", "break on preempt"),
        Binding("B", "breakpoints", "breakpoints", show=False),
        Binding("f", "follow", "follow req"),
        Binding("right_square_bracket", "request_event(False)", "its next event", show=False),
        Binding("left_square_bracket", "request_event(True)", "its prev event", show=False),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
        Binding("S", "sort_reverse", "reverse sort", show=False),
        Binding("z", "zoom", "zoom"),
        Binding("i", "incidents", "incidents"),
        Binding("m", "maximize", "maximize pane"),
        Binding("escape", "escape", "stop", show=False),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
    ]

    # The app's own attributes repaint nothing themselves (repaint=False): an App's
    # reactive repaints the whole screen, every pane, at every frame; the watchers hand
    # each pane its part, and a pane repaints itself when that part changes.
    frame: reactive[Frame | None] = reactive(None, repaint=False)  # the frame on screen
    # the selected request, by id: stable across steps
    selected_request: reactive[str | None] = reactive(None, repaint=False)
    selected_block: reactive[int | None] = reactive(None, repaint=False)
    query_text: reactive[str] = reactive("", repaint=False)  # the request filter
    sort_key: reactive[str] = reactive("arrival", repaint=False)
    sort_reverse: reactive[bool] = reactive(False, repaint=False)

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.source = FrameSource(session, self._frame_ready, self._notice)
        self.notices: list[tuple[str, str]] = []  # every notice shown (tests read them)
        self._main: Screen[object] | None = None  # the screen with the panes, once mounted
        self._trace = Path(session.name).name
        self._gc_threshold = gc.get_threshold()
        self._reveal: int | None = None  # at this step, scroll the selected request into view
        # A fix (`x` in the incidents view) re-runs the trace's file in a worker thread; a
        # stream has no file. The recorded config offers the first value to try.
        path = getattr(session.tl.reader, "path", None)
        self._fix_path: Path | None = path if isinstance(path, Path) else None
        self._config: dict[str, object] = dict(session.tl.header.config)
        self._fix: FixState | None = None  # the fix tried last, shown whenever `i` opens
        self._fix_seq = 0  # the newest fix asked for: an older one's result is dropped

    # -- layout -----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield StepHeader(id="header")
        with Vertical(id="requests-pane", classes="pane"):
            yield RequestTable(id="requests")
            yield Input(
                placeholder="filter: words in the id, state, kind or reason "
                "(enter: done, esc: clear)",
                id="filter",
            )
        with Horizontal(id="middle"):
            with Vertical(id="blocks-pane", classes="pane"):
                yield BlockMap(id="blocks")
                yield BlockDetail(id="block-detail")
            with Vertical(id="side"):
                with Vertical(id="sparks-pane", classes="pane"):
                    yield Sparklines(id="sparks")
                with Vertical(id="batch-pane", classes="pane"):
                    yield BatchBar(id="batch")
        with Vertical(id="events-pane", classes="pane"):
            yield EventLog(id="events")
        yield StatusLine(id="status")

    def on_mount(self) -> None:
        # The panes live on the main screen; dialogs go on top of it, so panes are found
        # there, never on whatever screen is current.
        self._main = self.screen
        self._main.set_class(self.size.height < SHORT, "-short")
        self.title = f"schedtop {self._trace}"
        self._pane(Widget, "#events-pane").border_title = "events"
        self._pane(Widget, "#sparks-pane").border_title = "history"
        self._pane(Widget, "#batch-pane").border_title = "batch"
        self._pane(RequestTable).focus()
        # Each frame allocates tens of thousands of short-lived objects (rows, segments,
        # strips): collect the young generation less often, and keep what exists now (the
        # app, the trace's first state) out of full collections, which otherwise stall a
        # frame now and then.
        self._gc_threshold = gc.get_threshold()
        gc.set_threshold(GC_THRESHOLD, *self._gc_threshold[1:])
        gc.freeze()
        self.run_worker(self.source.run, thread=True, name="reader", exit_on_error=False)

    def on_resize(self) -> None:
        if self._main is not None:
            self._main.set_class(self.size.height < SHORT, "-short")

    def on_unmount(self) -> None:
        self._main = None
        self.source.stop()
        gc.unfreeze()
        gc.set_threshold(*self._gc_threshold)

    # -- the reader thread ----------------------------------------------------------------------

    def _frame_ready(self) -> None:
        self.post_message(FrameReady())  # from the reader thread: post_message is safe

    def _notice(self, severity: str, text: str) -> None:
        self.post_message(Notice(severity, text))

    def on_frame_ready(self, _: FrameReady) -> None:
        frame = self.source.take()
        if frame is None or self._main is None:
            return
        with suppress(NoMatches):  # the app is closing: its panes are gone already
            self.frame = frame

    def on_notice(self, message: Notice) -> None:
        self.notices.append((message.severity, message.text))
        severity = message.severity if message.severity in ("warning", "error") else "information"
        self.notify(
            message.text,
            severity=severity,  # type: ignore[arg-type]
            timeout=10 if severity != "information" else 4,
            markup=False,
        )

    def _pane(self, kind: type[W], selector: str | None = None) -> W:
        """A widget of the main screen (dialogs may be on top of it)."""
        assert self._main is not None
        if selector is None:
            return self._main.query_one(kind)
        return self._main.query_one(selector, kind)

    def send(self, cmd: Command) -> None:
        self.source.send(cmd)

    # -- frames down to the panes ----------------------------------------------------------------

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        self._pane(StepHeader).vm = frame.header
        self._update_table()
        blocks = self._pane(BlockMap)
        blocks.vm = frame.blocks
        blocks.highlight = self._selected_ref()
        detail = self._pane(BlockDetail)
        detail.frame = frame
        detail.pool = frame.blocks.pool
        detail.per_cell = blocks.geometry.per_cell
        detail.aggregate = blocks.geometry.zoom == "fit"
        self._pane(Sparklines).vm = frame.sparks
        self._pane(BatchBar).vm = frame.batch
        log = self._pane(EventLog)
        if log.events != frame.events:
            log.events = frame.events
        log.step = frame.header.step
        log.followed = frame.header.followed
        self._titles()
        self._pane(StatusLine).text = frame.header.status
        if isinstance(self.screen, IncidentsScreen):
            self.screen.vm = frame.incidents

    def _update_table(self) -> None:
        frame = self.frame
        if frame is None:
            return
        table = self._pane(RequestTable)
        table.sort = (self.sort_key, self.sort_reverse)
        table.rows = table_rows(frame.requests, self.query_text, self.sort_key, self.sort_reverse)
        table.selected = self.selected_request
        table.followed = frame.header.followed
        table.keep_prio = frame.header.priority_policy
        reveal = frame.header.followed == self.selected_request or self._reveal == frame.header.step
        if self.selected_request is not None and reveal:
            i = table.index_of(self.selected_request)
            if i >= 0:
                table.scroll_to_row(i)
                # Back from the incidents view, the table is laid out again first.
                self.call_after_refresh(table.scroll_to_row, i)

    def _titles(self) -> None:
        frame = self.frame
        if frame is None:
            return
        shown = len(self._pane(RequestTable).rows)
        total = len(frame.requests)
        order = f"{self.sort_key}{' ▼' if self.sort_reverse else ''}"
        count = f"{shown} of {total}" if self.query_text else str(total)
        vm, batch = frame.blocks, frame.batch
        used = sum(e.tokens for e in batch.entries)
        drawn = self._pane(Sparklines).drawn()
        log = self._pane(EventLog)
        head = f" · {frame.header.queue_head}" if frame.header.queue_head else ""
        below = [f"filter: {self.query_text}"] if self.query_text else []
        waited = self._wait_line()
        if waited:
            below.append(waited)
        titles = {
            "#requests-pane": (f"requests {count}{head} · sorted by {order}", " · ".join(below)),
            "#blocks-pane": (
                (
                    f"token pool (SGLang) {vm.num_blocks - 1} slots · "
                    + self._pane(BlockMap).title.replace("block", "slot")
                    if vm.pool == "tokens"
                    else f"KV blocks {vm.num_blocks - 1} × {vm.block_size} tokens · "
                    f"{self._pane(BlockMap).title}"
                ),
                "",
            ),
            "#batch-pane": (
                f"batch: {len(batch.entries)} requests, {used}/{batch.budget} tokens",
                "",
            ),
            "#events-pane": (
                "events" + (f" · {log.kind} only" if log.kind else ""),
                "c: kind  ↑↓: scroll" if log.has_focus else "",
            ),
            "#sparks-pane": (
                f"history: steps {drawn[0]}–{drawn[1]}" if drawn else "history",
                "",
            ),
        }
        for selector, (title, subtitle) in titles.items():
            pane = self._pane(Widget, selector)
            # Setting a title repaints the pane: only when it changes.
            if pane.border_title != title:
                pane.border_title = title
            if (pane.border_subtitle or "") != subtitle:
                pane.border_subtitle = subtitle

    def _wait_line(self) -> str:
        """The selected request's wait and why, if it is waiting."""
        frame, rid = self.frame, self.selected_request
        if frame is None or rid is None:
            return ""
        row = next((r for r in frame.requests if r.request_id == rid), None)
        if row is None or row.wait is None:
            return ""
        steps = f"{row.wait}{'' if row.wait_exact else '+'} step{'' if row.wait == 1 else 's'}"
        time = f" ({duration(row.wait_ns)})" if row.wait_ns is not None else ""
        return f"{short_id(rid)} waited {steps}{time}: {row.wait_why}"

    def _selected_ref(self) -> int | None:
        frame, rid = self.frame, self.selected_request
        if frame is None or rid is None:
            return None
        return next((r.ref for r in frame.requests if r.request_id == rid), None)

    def watch_selected_request(self) -> None:
        self._pane(RequestTable).selected = self.selected_request
        self._pane(BlockMap).highlight = self._selected_ref()
        self._titles()

    def watch_selected_block(self, block: int | None) -> None:
        self._pane(BlockMap).selected = block
        detail = self._pane(BlockDetail)
        detail.block = block
        detail.per_cell = self._pane(BlockMap).geometry.per_cell

    def watch_query_text(self) -> None:
        self._update_table()
        self._titles()

    def watch_sort_key(self) -> None:
        self._update_table()
        self._titles()

    def watch_sort_reverse(self) -> None:
        self._update_table()
        self._titles()

    # -- messages up from the panes ----------------------------------------------------------

    def on_request_table_selected(self, message: RequestTable.Selected) -> None:
        self.selected_request = message.request_id

    def on_request_table_sort_clicked(self, message: RequestTable.SortClicked) -> None:
        if message.key == self.sort_key:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_key, self.sort_reverse = message.key, message.key in NUMERIC_SORTS

    def on_event_log_kind_changed(self, _: EventLog.KindChanged) -> None:
        self._titles()

    def on_descendant_focus(self) -> None:
        self._titles()

    def on_descendant_blur(self) -> None:
        self._titles()

    def on_step_clicked(self, message: StepClicked) -> None:
        self.send(Goto(message.step))

    def on_block_map_laid(self, message: BlockMap.Laid) -> None:
        detail = self._pane(BlockDetail)
        detail.per_cell = message.geometry.per_cell
        detail.aggregate = message.geometry.zoom == "fit"
        self._titles()

    def on_block_map_selected(self, message: BlockMap.Selected) -> None:
        self.selected_block = message.block
        self._pane(BlockMap)._scroll_to_selected()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self.query_text = event.value

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self._pane(RequestTable).focus()
            if not event.value:
                event.input.display = False

    # -- actions --------------------------------------------------------------------------------

    def action_play(self) -> None:
        self.send(TogglePlay())

    def action_move(self, delta: int) -> None:
        self.send(Move(delta))

    def action_edge(self, end: bool) -> None:
        self.send(GotoEdge(end))

    def action_speed(self, faster: bool) -> None:
        self.send(Speed(faster))

    def action_find(self, backward: bool) -> None:
        self.send(FindBreak(backward))

    def action_toggle_preempt(self) -> None:
        self.send(ToggleBreakpoint(PREEMPT))

    def action_goto(self) -> None:
        def go(result: tuple[str, int] | None) -> None:
            if result is None:
                return
            kind, n = result
            if kind == "edge":  # gg
                self.send(GotoEdge(bool(n)))
            else:
                self.send(Goto(n) if kind == "step" else Move(n) if kind == "move" else GotoTime(n))

        self.push_screen(goto_screen(), go)

    def action_breakpoints(self) -> None:
        def done(result: tuple[Predicate, ...] | None) -> None:
            if result is not None:
                self.send(SetBreakpoints(result))

        current = self.frame.header.breakpoints if self.frame is not None else ()
        self.push_screen(breakpoints_screen(current), done)

    def action_follow(self) -> None:
        followed = self.frame.header.followed if self.frame is not None else None
        rid = self.selected_request
        if rid is None and followed is None:
            self.notify("select a request to follow first (↑/↓ or a click)")
        elif rid is None or rid == followed:
            self.send(FollowRequest(None))
        else:
            self.send(FollowRequest(rid))

    def action_request_event(self, backward: bool) -> None:
        followed = self.frame.header.followed if self.frame is not None else None
        rid = followed or self.selected_request
        if rid is None:
            self.notify("select a request first (↑/↓ or a click), or follow one with f")
            return
        self.send(FindRequest(rid, backward))

    def action_filter(self) -> None:
        box = self._pane(Input, "#filter")
        box.display = True
        box.focus()

    def action_sort(self) -> None:
        i = SORT_KEYS.index(self.sort_key)
        key = SORT_KEYS[(i + 1) % len(SORT_KEYS)]
        self.sort_key, self.sort_reverse = key, key in NUMERIC_SORTS

    def action_sort_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse

    def action_zoom(self) -> None:
        blocks = self._pane(BlockMap)
        blocks.zoom = ZOOMS[(ZOOMS.index(blocks.geometry.zoom) + 1) % len(ZOOMS)]
        self._pane(BlockDetail).per_cell = blocks.geometry.per_cell
        self._pane(BlockDetail).aggregate = blocks.geometry.zoom == "fit"
        self._titles()

    def action_escape(self) -> None:
        box = self._pane(Input, "#filter")
        if box.has_focus or self.query_text:
            box.value = ""
            box.display = False
            self._pane(RequestTable).focus()
            return
        busy = self.frame is not None and self.frame.header.mode in ("SEARCHING", "PLAYING")
        if self.selected_block is not None and not busy:
            self.selected_block = None  # the block map's legend comes back
            return
        self.send(Cancel())

    def action_incidents(self) -> None:
        def chosen(incident: Incident | None) -> None:
            self.send(WatchIncidents(False))
            if incident is not None:
                self._reveal = incident.step
                self.selected_request = incident.request_id
                self.send(Goto(incident.step))

        self.send(WatchIncidents(True))
        vm = self.frame.incidents if self.frame is not None else None
        self.push_screen(IncidentsScreen(vm, self._config, self._fix), chosen)

    def on_incidents_screen_try_fix(self, message: IncidentsScreen.TryFix) -> None:
        """Run the trace again with the setting in a worker thread (a re-simulation takes
        seconds); the incidents view shows it running, then what it changed."""
        setting, about = message.setting, message.about
        self._fix_seq += 1
        seq = self._fix_seq
        path = self._fix_path
        if path is None:
            self._show_fix(
                FixState(
                    setting,
                    error="no trace file behind this view (a stream): "
                    "try it on the server's run directory",
                ),
                seq,
            )
            return
        self._show_fix(FixState(setting), seq)

        def run() -> FixState:
            from replays.fix import try_fix

            try:
                return FixState(setting, try_fix(path, setting, about))
            except Exception as e:  # a bad knob or value, a trace it cannot run: said, not raised
                return FixState(setting, error=str(e).splitlines()[0] if str(e) else repr(e))

        def work() -> None:
            # The run itself goes in a daemon thread: a re-simulation cannot be stopped
            # half way, and quitting must not wait for it (Textual's thread workers are
            # joined at exit). The worker waits for it or for its own cancellation.
            done: list[FixState] = []
            finished = threading.Event()

            def job() -> None:
                done.append(run())
                finished.set()

            threading.Thread(target=job, name="fix", daemon=True).start()
            worker = get_current_worker()
            while not finished.wait(0.25):
                if worker.is_cancelled:
                    return
            if not worker.is_cancelled:
                self.call_from_thread(self._show_fix, done[0], seq)

        self.run_worker(work, thread=True, name="fix", group="fix", exit_on_error=False)

    def _show_fix(self, state: FixState, seq: int) -> None:
        if seq != self._fix_seq:
            return  # a newer fix was asked for meanwhile
        self._fix = state
        for screen in self.screen_stack:
            if isinstance(screen, IncidentsScreen):
                screen.fix = state

    def action_maximize(self) -> None:
        """The focused pane over the whole screen (between the header and the status
        line); again, or esc, puts it back."""
        screen = self._main
        if screen is None or screen is not self.screen:
            return
        if screen.maximized is not None:
            screen.minimize()
            return
        focused = screen.focused
        pane = next(
            (
                w
                for w in (focused.ancestors if focused else ())
                if isinstance(w, Widget) and w.has_class("pane")
            ),
            None,
        )
        if pane is not None:
            # Not Screen.maximize(): the panes are containers, which it refuses (they
            # cannot take focus themselves).
            screen.maximized = pane

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
