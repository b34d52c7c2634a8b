"""The status line at the bottom: the newest navigation message (a breakpoint hit, the
request followed) on the left, the keys that matter most on the right, at any width."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tui.widgets.lines import TextLines

ALWAYS = (("?", "help"), ("q", "quit"))  # shown at any width
MORE = (
    ("space", "play"),
    ("n", "next break"),
    ("/", "filter"),
    ("tab", "pane"),
    ("i", "incidents"),
)


class StatusLine(TextLines):
    """One line: the status message, and key hints that drop out before `? help`."""

    DEFAULT_CSS = """
    StatusLine { height: 1; background: #2c313a; }
    """

    text: reactive[str] = reactive("")

    def lines(self, width: int, height: int) -> list[Text]:
        keys = list(ALWAYS)
        for extra in reversed(MORE):
            if _width(self.text, [extra, *keys]) > width:
                break
            keys.insert(0, extra)
        hints = Text()
        for key, what in keys:
            hints.append(f" {key} ", style="bold #1e2127 on #e5c07b")
            hints.append(f" {what} ", style="#abb2bf")
        room = max(0, width - hints.cell_len)
        line = Text(no_wrap=True, overflow="ellipsis")
        status = Text(f" {self.text}", style="bold #e5c07b")
        status.truncate(room, overflow="ellipsis", pad=True)
        line.append_text(status)
        line.append_text(hints)
        return [line]


def _width(text: str, keys: list[tuple[str, str]]) -> int:
    """Cells for a status of `text` (at least a few words of it) and `keys`."""
    status = min(len(text) + 1, 60)
    return status + sum(len(k) + len(w) + 4 for k, w in keys)
