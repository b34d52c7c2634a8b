"""The incidents table: one line per preemption (or abort, or error), drawn line by line
so that a storm of a hundred thousand costs what a screenful does."""

from __future__ import annotations

from functools import cache

from rich.segment import Segment
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from replays.storms import Incident, IncidentKind
from tui.format import middle
from tui.widgets import palette
from tui.widgets.lines import line_keys
from tui.widgets.requests import Column, fit, full_strip, id_cells

_HEADER = palette.style("#abb2bf", "#2c313a", bold=True)
_CURSOR_BG = "#3e4451"
_KIND = {
    IncidentKind.PREEMPT: "#e06c75",
    IncidentKind.ABORT: "#d19a66",
    IncidentKind.ERROR: "#e06c75",
}


COLUMNS = (
    Column("step", "step", 7, True),
    Column("", "kind", 7, False),
    Column("request", "victim", 10, False),
    Column("", "for / why", 10, False),
    Column("lost", "lost", 5, True),
    Column("free", "free →", 9, True),
    Column("count", "pre#", 4, True),
    Column("", "thrash", 0, False),
)


def cells(i: Incident) -> tuple[str, ...]:
    return (
        str(i.step),
        i.kind,
        i.request_id,
        i.cause,
        str(i.tokens_lost) if i.kind == IncidentKind.PREEMPT else "",
        f"{i.free_before} → {i.free_after}",
        str(i.count) if i.kind == IncidentKind.PREEMPT else "",
        i.thrash,
    )


def widths(rows: tuple[Incident, ...], width: int) -> tuple[int, int]:
    """The victim's and the cause's columns for these rows at `width`: as wide as their
    longest text (ids up to id_cells, a cause up to a third of the table), so that
    `aborted by the client` is not cut with 40 cells left over."""
    victim = max((len(i.request_id) for i in rows), default=0)
    cause = max((len(i.cause) for i in rows), default=0)
    return (
        max(6, min(victim, id_cells(width))),
        max(
            9,
            min(
                cause,
                id_cells(width)
                if all(i.kind == IncidentKind.PREEMPT for i in rows)
                else width // 3,
            ),
        ),
    )


@cache
def layout(width: int, victim: int = 10, cause: int = 10) -> tuple[tuple[Column, int], ...]:
    """(column, width) of the columns that fit in `width` cells, the last taking the rest."""
    out: list[tuple[Column, int]] = []
    x = 1
    for col in COLUMNS:
        w = victim if col.sort == "request" else cause if col.title == "for / why" else col.width
        w = w or max(0, width - x)
        if x + min(w, 4) > width:
            break
        w = min(w, width - x)
        out.append((col, w))
        x += w + 1
    return tuple(out)


class IncidentTable(ScrollView, can_focus=True, inherit_bindings=False):
    """Incidents with a cursor row; enter asks to go to the cursor's step."""

    BINDINGS = [
        *line_keys("cursor", ends=("first", "last")),
        Binding("enter", "choose", "go to its step", show=False),
    ]

    rows: reactive[tuple[Incident, ...]] = reactive((), always_update=True)
    cursor: reactive[int] = reactive(0)
    sort: reactive[tuple[str, bool]] = reactive(("step", False))

    class Chosen(Message):
        """The user picked an incident (enter or a click)."""

        def __init__(self, incident: Incident) -> None:
            super().__init__()
            self.incident = incident

    _widths = (10, 10)  # the victim's and the cause's columns, from the rows

    def columns(self, width: int) -> tuple[tuple[Column, int], ...]:
        return layout(width, *self._widths)

    def watch_rows(self) -> None:
        self._widths = widths(self.rows, self.size.width)
        self.virtual_size = Size(self.size.width, len(self.rows) + 1)
        if self.cursor >= len(self.rows):
            self.cursor = max(0, len(self.rows) - 1)
        self.refresh()

    def watch_cursor(self) -> None:
        self.refresh()

    def on_resize(self) -> None:
        self.watch_rows()

    def action_cursor(self, delta: int) -> None:
        if not self.rows:
            return
        # From the cursor as it is now, not as last drawn: fast repeated keys all count.
        self.cursor = min(max(self.cursor + delta, 0), len(self.rows) - 1)
        self.scroll_to_region(Region(0, self.cursor, 1, 2), animate=False)

    def action_choose(self) -> None:
        if 0 <= self.cursor < len(self.rows):
            self.post_message(self.Chosen(self.rows[self.cursor]))

    def on_click(self, event: events.Click) -> None:
        at = event.get_content_offset(self)
        if at is None or at.y == 0:
            return
        i = self.scroll_offset.y + at.y - 1
        if 0 <= i < len(self.rows):
            self.cursor = i
            self.post_message(self.Chosen(self.rows[i]))

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width  # a vertical scrollbar covers the rest
        if y == 0:
            return self._title(width)
        i = self.scroll_offset.y + y - 1
        if i >= len(self.rows):
            return Strip.blank(width)
        return self._row(self.rows[i], i == self.cursor, width)

    def _title(self, width: int) -> Strip:
        key, descending = self.sort
        segments = [Segment(" ", _HEADER)]
        used = 1
        for col, w in self.columns(width):
            arrow = (" ▼" if descending else " ▲") if col.sort == key else ""
            segments.append(Segment(fit(col.title, w, col.right, arrow) + " ", _HEADER))
            used += w + 1
        return full_strip(segments, used, width, _HEADER)

    def _row(self, i: Incident, current: bool, width: int) -> Strip:
        bg = _CURSOR_BG if current else None
        base = palette.style("#dcdfe4" if current else "#abb2bf", bg)
        segments = [Segment("▶" if current else " ", palette.style("#ffffff", bg, bold=True))]
        used = 1
        for (col, w), text in zip(self.columns(width), cells(i)):
            style = base
            if col.sort == "request" or (
                col.title == "for / why" and i.kind == IncidentKind.PREEMPT
            ):
                text = middle(text, w)  # ids: both ends
            if col.title == "kind":
                style = palette.style(_KIND.get(i.kind, "#abb2bf"), bg, bold=True)
            elif col.title == "thrash" and i.thrash:
                style = palette.style("#e5c07b", bg, bold=True)
            segments.append(Segment(fit(text, w, col.right) + " ", style))
            used += w + 1
        return full_strip(segments, used, width, base)
