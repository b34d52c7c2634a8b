"""The event log: arrivals, admissions (prefix hit or miss), evictions of cached blocks,
preemptions, finishes and aborts up to the step.

It can take the focus (tab): then ↑/↓, page up/down, home/end scroll it, and `c` cycles a
filter through the kinds. Unfocused and unscrolled, it stays on the newest lines."""

from __future__ import annotations

from rich.segment import Segment
from rich.text import Text
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.format import shorten_ids
from tui.history import Event
from tui.widgets import palette
from tui.widgets.lines import StepClicked, line_keys, set_virtual_size

_TAGS = {
    "arrive": "arrive",
    "admit": "admit",
    "evict": "evict",
    "preempt": "PREEMPT",
    "finish": "finish",
    "abort": "ABORT",
    "break": "BREAK",
    "note": "note",
}
FILTERS = ("", "preempt", "admit", "evict", "finish", "abort", "arrive")  # "": every kind


class EventLog(ScrollView, can_focus=True, inherit_bindings=False):
    """The events, oldest at the top; the shown step's are marked."""

    DEFAULT_CSS = """
    EventLog { height: 1fr; scrollbar-size-vertical: 1; overflow-x: hidden; }
    """

    BINDINGS = [
        *line_keys("scroll_by", ends=("top", "bottom")),
        Binding("c", "cycle_kind", "kind filter", show=False),
    ]

    events: reactive[tuple[Event, ...]] = reactive(())
    step: reactive[int] = reactive(-1)
    followed: reactive[str | None] = reactive(None)
    kind: reactive[str] = reactive("")  # the kind shown ("": every kind)

    class KindChanged(Message):
        """The filter changed (the pane's title says which)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple[Event, ...] = ()
        self._pinned = True  # on the newest line, until the user scrolls up

    def _update(self) -> None:
        self._shown = (
            tuple(e for e in self.events if e.kind == self.kind) if self.kind else self.events
        )
        set_virtual_size(self, Size(self.size.width, len(self._shown)))
        if self._pinned:
            # The new size applies after this refresh: scroll then (render_line draws the
            # newest lines meanwhile).
            self.call_after_refresh(self.scroll_end, animate=False)
        self.refresh()

    def _top(self) -> int:
        """The first line shown."""
        if self._pinned:
            return max(0, len(self._shown) - self.size.height)
        return self.scroll_offset.y

    def watch_events(self) -> None:
        self._update()

    def watch_step(self) -> None:
        self.refresh()

    def watch_followed(self) -> None:
        self.refresh()

    def watch_kind(self) -> None:
        self._pinned = True
        self._update()
        self.post_message(self.KindChanged())

    def on_resize(self) -> None:
        self._update()

    def action_scroll_by(self, lines: int) -> None:
        y = min(max(self._top() + lines, 0), max(0, len(self._shown) - self.size.height))
        self.scroll_to(y=y, animate=False, immediate=True)
        self._pinned = y >= len(self._shown) - self.size.height
        self.refresh()

    def action_cycle_kind(self) -> None:
        self.kind = FILTERS[(FILTERS.index(self.kind) + 1) % len(FILTERS)]

    def on_click(self, event: Click) -> None:
        """A click on an event goes to its step."""
        at = event.get_content_offset(self)
        if at is None:
            return
        i = self._top() + at.y
        if 0 <= i < len(self._shown):
            self.post_message(StepClicked(self._shown[i].step))

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        shown = self._shown
        i = self._top() + y
        if not shown and y == 0:
            what = f"no {self.kind} events" if self.kind else "no events"
            text = Text(f"{what} in the steps before this one", style="italic #7f848e")
        elif 0 <= i < len(shown):
            e = shown[i]
            text = line(e, e.step == self.step, self.followed)
        else:
            return Strip.blank(width, self.rich_style)
        text.truncate(width, overflow="ellipsis", pad=True)
        base = self.rich_style
        segments = [
            Segment(s.text, base + s.style if s.style else base)
            for s in text.render(self.app.console)
        ]
        return Strip(segments, width)


def line(e: Event, current: bool, followed: str | None) -> Text:
    """One log line: step, coloured tag, text."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("▶" if current else " ", style="bold #ffffff")
    t.append(f"{e.step:>7} ", style="bold" if current else "#7f848e")
    colour = palette.EVENTS.get(e.kind, "#abb2bf")
    t.append(f"{_TAGS.get(e.kind, e.kind):<8}", style=f"bold {colour}")
    mine = followed is not None and followed in e.requests
    text = shorten_ids(e.text, e.requests)  # long server ids, cut in the middle
    t.append(text, style="bold underline" if mine else ("" if current else "#abb2bf"))
    return t
