"""A pane drawn as lines of Rich Text through Textual's line API.

Textual turns a `render()` result into its own Content and lays it out, which costs a few
milliseconds per pane per frame; these panes know their lines already, so each line goes
straight to segments (and is cached until the pane's attributes change)."""

from __future__ import annotations

from rich.segment import Segment
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Region, Size
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

FAR = 1_000_000_000  # lines: home and end move this far, and the action clamps it


def line_keys(
    action: str, page: int = 10, ends: tuple[str, str] | None = None
) -> list[BindingType]:
    """The keys that move a list pane by lines, bound to `action(lines)`: up/k and down/j
    one line, page up/down `page` lines; with `ends` (what they are called: "first",
    "last") home and end to the first and the last line. One set for every pane, so
    that they all move alike; none shows in the footer."""
    moves = [("up,k", -1, "up"), ("down,j", 1, "down")]
    moves += [("pageup", -page, "page up"), ("pagedown", page, "page down")]
    if ends is not None:
        moves += [("home", -FAR, ends[0]), ("end", FAR, ends[1])]
    return [Binding(key, f"{action}({n})", word, show=False) for key, n, word in moves]


def set_virtual_size(widget: Widget, size: Size) -> None:
    """Give a scrolling pane a new virtual size without laying out the whole screen
    again: Textual's `virtual_size` asks for a layout on every change, and a layout
    repaints every pane (a live view's log and tables grow at every frame). The
    scrollbars are still brought up to date, and a scrollbar that appears or goes
    still asks for the layout it needs (Widget._scroll_update sets their visibility)."""
    if widget.virtual_size == size:
        return
    scroll_update = getattr(widget, "_scroll_update", None)
    if scroll_update is None:  # a Textual without it: the plain way, layout and all
        widget.virtual_size = size
        return
    widget.set_reactive(Widget.virtual_size, size)
    if widget.is_scrollable and widget.container_size:
        scroll_update(size)


class StepClicked(Message):
    """The user clicked something that stands for a step (a sparkline column, an event)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step


class TextLines(Widget):
    """A widget whose content is `lines(width, height)`: one Text per line, no wrapping."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._cache: tuple[int, int, list[Strip]] | None = None  # width, height, strips

    def lines(self, width: int, height: int) -> list[Text]:
        raise NotImplementedError

    def refresh(self, *args: object, **kwargs: object) -> TextLines:
        self._cache = None
        super().refresh(*args, **kwargs)  # type: ignore[arg-type]
        return self

    def render_lines(self, crop: Region) -> list[Strip]:
        # The size once per pass: it is computed afresh each time it is asked for.
        width, height = self.size
        cache = self._cache
        if cache is None or cache[:2] != (width, height):
            self._cache = (
                width,
                height,
                [self._strip(t, width) for t in self.lines(width, height)],
            )
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        assert self._cache is not None
        width, _, strips = self._cache
        return strips[y] if y < len(strips) else Strip.blank(width, self.rich_style)

    def _strip(self, text: Text, width: int) -> Strip:
        base = self.rich_style
        text.no_wrap = True
        text.overflow = "ellipsis"
        text.truncate(width, pad=True)
        segments = [
            Segment(s.text, base + s.style if s.style else base)
            for s in text.render(self.app.console)
        ]
        return Strip(segments, width)
