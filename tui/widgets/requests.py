"""The request table: one line per request, drawn line by line (only the visible lines
are rendered, so a thousand requests cost what a screenful does)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.format import middle
from tui.viewmodel import RequestRow
from tui.widgets import palette
from tui.widgets.lines import line_keys, set_virtual_size


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a line-drawn table (the requests, the incidents)."""

    sort: str  # the sort key a click on its title picks ("": not sortable)
    title: str  # its title
    width: int  # its width in cells (0: whatever is left)
    right: bool  # right-aligned


COLUMNS = (
    Column("id", "request", 12, False),
    Column("state", "state", 9, False),
    Column("tokens", "computed/all", 12, True),
    Column("", "out/max", 8, True),
    Column("blocks", "blocks", 6, True),
    Column("preempted", "pre", 4, True),
    Column("priority", "prio", 5, True),
    Column("wait", "wait", 5, True),
    Column("queued", "queued", 7, True),
    Column("ttft", "ttft", 5, True),
    Column("step", "this step", 12, False),
    Column("", "why not scheduled", 0, False),
)
# Columns left out, in this order, until "why not scheduled" has WHY_MIN cells (under
# the priority policy "prio" is what a diagnosis reads first: it stays).
DROP = ("prio", "out/max", "ttft", "queued", "this step", "blocks", "pre")
WHY_MIN = 24
ID_MIN = 7  # the id column's title, "request"


def id_cells(width: int) -> int:
    """The most cells the id column takes in a table `width` cells wide: enough for
    `chatcmpl-…bbfe7` at 80 columns, a whole OpenAI id at 200."""
    return 16 if width < 110 else 24 if width < 160 else 44


_GUTTER = 3  # the followed marker, the colour swatch, a space
_TITLES = tuple(c.title for c in COLUMNS)
_HEADER = palette.style("#abb2bf", "#2c313a", bold=True)
_CURSOR_BG = "#3e4451"


def cells(row: RequestRow) -> tuple[str, ...]:
    """A row's text, column by column."""
    queued = (
        "—" if row.queued is None else f"{row.queued}+" if row.still_queued else str(row.queued)
    )
    return (
        row.request_id,
        row.state,
        f"{row.computed}/{row.total}",
        f"{row.output}/{row.max_tokens}",
        str(row.blocks),
        str(row.preemptions),
        str(row.priority),
        "" if row.wait is None else f"{row.wait}{'' if row.wait_exact else '+'}",
        queued,
        "—" if row.ttft is None else str(row.ttft),
        f"+{row.scheduled} {row.kind}" if row.scheduled else "",
        row.why,
    )


@cache
def layout(
    width: int, id_width: int = 12, keep_prio: bool = False
) -> tuple[tuple[Column, int, int], ...]:
    """(column, x, width) for a table `width` cells wide whose ids take `id_width`
    cells: the columns of DROP (but "prio" when `keep_prio`) are left out, in order,
    until "why not scheduled" (the last, which takes what is left) has WHY_MIN cells;
    then any that still do not fit."""
    shown = [replace(c, width=id_width) if c.sort == "id" else c for c in COLUMNS]
    for title in DROP:
        if keep_prio and title == "prio":
            continue
        fixed = _GUTTER + sum(c.width + 1 for c in shown if c.width)
        if width - fixed >= WHY_MIN:
            break
        shown = [c for c in shown if c.title != title]
    out = []
    x = _GUTTER
    for col in shown:
        w = col.width or max(0, width - x)
        if x + min(w, 4) > width:
            break
        w = min(w, width - x)
        out.append((col, x, w))
        x += w + 1
    return tuple(out)


def fit(text: str, width: int, right: bool, suffix: str = "") -> str:
    """`text` in exactly `width` cells: cut with an ellipsis, or padded. A `suffix` (a
    sort arrow) is never cut: the text makes room for it."""
    if suffix:
        if cell_len(text) + cell_len(suffix) > width:
            suffix = suffix.strip()  # a narrow column: the arrow right after the text
        room = max(0, width - cell_len(suffix))
        return fit(fit(text, room, False).rstrip() + suffix, width, right)
    if not text.isascii():  # wide characters: measure cells, not characters
        return (
            set_cell_size(text, width)
            if cell_len(text) > width or not right
            else " " * (width - cell_len(text)) + text
        )
    if len(text) > width:
        return text[: max(0, width - 1)] + "…" if width > 1 else text[:width]
    return text.rjust(width) if right else text.ljust(width)


def full_strip(segments: list[Segment], used: int, width: int, style: Style) -> Strip:
    """A line of exactly `width` cells from segments `used` cells wide (telling Strip the
    length spares it measuring every segment)."""
    if used < width:
        segments.append(Segment(" " * (width - used), style))
        return Strip(segments, width)
    return Strip(segments, used).crop(0, width) if used > width else Strip(segments, width)


class RequestTable(ScrollView, can_focus=True, inherit_bindings=False):
    """Requests, sorted and filtered by the app; click or arrow to select one."""

    DEFAULT_CSS = """
    RequestTable { height: 1fr; scrollbar-size-vertical: 1; overflow-x: hidden; }
    """

    # Not the scrolling keys of ScrollView: ← → home end move through the steps.
    BINDINGS = line_keys("cursor")

    rows: reactive[tuple[RequestRow, ...]] = reactive((), always_update=True)
    selected: reactive[str | None] = reactive(None)  # the selected request's id
    followed: reactive[str | None] = reactive(None)  # the followed request's id
    sort: reactive[tuple[str, bool]] = reactive(("arrival", False))  # key, descending
    keep_prio: reactive[bool] = reactive(False)  # the priority policy: never drop "prio"

    class Selected(Message):
        """The user picked a request."""

        def __init__(self, request_id: str) -> None:
            super().__init__()
            self.request_id = request_id

    class SortClicked(Message):
        """The user clicked a column title."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    _width = _top = 0  # the width and the scroll offset of the pass being rendered
    _id_width = 12  # the id column's width, from the longest id of the rows

    def watch_rows(self) -> None:
        self._id_width = max(
            ID_MIN,
            min(max((len(r.request_id) for r in self.rows), default=0), id_cells(self.size.width)),
        )
        set_virtual_size(self, Size(self.size.width, len(self.rows) + 1))
        self.refresh()

    def watch_keep_prio(self) -> None:
        self.refresh()

    def columns(self, width: int) -> tuple[tuple[Column, int, int], ...]:
        """The columns shown at `width`, for these rows and this policy."""
        return layout(width, self._id_width, self.keep_prio)

    def on_resize(self) -> None:
        self.watch_rows()

    def index_of(self, request_id: str | None) -> int:
        return next((i for i, r in enumerate(self.rows) if r.request_id == request_id), -1)

    def action_cursor(self, delta: int) -> None:
        if not self.rows:
            return
        i = self.index_of(self.selected)
        i = 0 if i < 0 else min(max(i + delta, 0), len(self.rows) - 1)
        # Selected here at once, not only when the app answers the message: six fast
        # presses must each move from where the last one left the cursor.
        self.selected = self.rows[i].request_id
        self.post_message(self.Selected(self.rows[i].request_id))
        self.scroll_to_row(i)

    def scroll_to_row(self, i: int) -> None:
        # Line 0 is the title line, which never scrolls: row i is content line i + 1.
        self.scroll_to_region(Region(0, i, 1, 2), animate=False)

    def on_click(self, event: events.Click) -> None:
        at = event.get_content_offset(self)
        if at is None:
            return
        if at.y == 0:
            for col, x, w in self.columns(self.scrollable_content_region.width):
                if x <= at.x < x + w and col.sort:
                    self.post_message(self.SortClicked(col.sort))
            return
        i = self.scroll_offset.y + at.y - 1
        if 0 <= i < len(self.rows):
            self.post_message(self.Selected(self.rows[i].request_id))

    def render_lines(self, crop: Region) -> list[Strip]:
        # Once per pass: these are computed afresh each time they are read.
        # Not size.width: a vertical scrollbar covers the last cell of it.
        self._width, self._top = self.scrollable_content_region.width, self.scroll_offset.y
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        width = self._width
        if y == 0:
            return self._title(width)
        i = self._top + y - 1
        if i >= len(self.rows):
            return Strip.blank(width)
        return self._row(self.rows[i], width)

    def _title(self, width: int) -> Strip:
        key, descending = self.sort
        segments = [Segment(" " * _GUTTER, _HEADER)]
        used = _GUTTER
        for col, _, w in self.columns(width):
            arrow = (" ▼" if descending else " ▲") if col.sort == key else ""
            segments.append(Segment(fit(col.title, w, col.right, arrow) + " ", _HEADER))
            used += w + 1
        return full_strip(segments, used, width, _HEADER)

    def _row(self, row: RequestRow, width: int) -> Strip:
        selected = row.request_id == self.selected
        followed = row.request_id == self.followed
        bg = _CURSOR_BG if selected else None
        base = palette.style("#dcdfe4" if selected else "#abb2bf", bg, bold=followed)
        segments = [
            Segment("▶" if followed else " ", palette.style("#ffffff", bg, bold=True)),
            Segment("■", palette.style(palette.owner(row.ref), bg)),
            Segment(" ", base),
        ]
        used = _GUTTER
        texts = dict(zip(_TITLES, cells(row)))
        for col, _, w in self.columns(width):
            text = texts[col.title]
            if col.sort == "id":  # ids differ at their end: cut in the middle
                text = middle(text, w)
            segments.append(Segment(fit(text, w, col.right) + " ", self._style(col, row, base, bg)))
            used += w + 1
        return full_strip(segments, used, width, base)

    @staticmethod
    def _style(col: Column, row: RequestRow, base: Style, bg: str | None) -> Style:
        if col.sort == "state":
            return palette.style(palette.STATES.get(row.state, "#abb2bf"), bg)
        if col.sort == "step" and row.kind:
            return palette.style(palette.KINDS.get(row.kind, "#abb2bf"), bg)
        if not col.sort and col.width == 0 and row.why:
            return palette.style("#d19a66", bg)
        if col.sort == "preempted" and row.preemptions:
            return palette.style("#e06c75", bg, bold=True)
        return base
