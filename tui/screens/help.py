"""The `?` screen: every key."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tui.keys import KEYS, LEFT_SECTIONS


def key_table(width: int = 120) -> Table:
    """The keys, section by section: in two columns of sections when `width` allows,
    else in one (the screen scrolls)."""
    sections = [_section(title, keys) for title, keys in KEYS]
    grid = Table.grid(padding=(0, 4))
    grid.add_column()
    if width < TWO_COLUMNS:
        grid.add_row(_stack(sections))
        return grid
    grid.add_column()
    grid.add_row(_stack(sections[:LEFT_SECTIONS]), _stack(sections[LEFT_SECTIONS:]))
    return grid


TWO_COLUMNS = 100  # terminal columns that fit two columns of sections


def _section(title: str, keys: tuple[tuple[str, str], ...]) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold #e5c07b", no_wrap=True, min_width=12)
    t.add_column(style="#dcdfe4", no_wrap=True)
    t.add_row(Text(title, style="bold underline #61afef"), "")
    for key, what in keys:
        t.add_row(key, what)
    return t


def _stack(tables: list[Table]) -> Table:
    t = Table.grid()
    for table in tables:
        t.add_row(table)
        t.add_row("")
    return t


class HelpScreen(ModalScreen[None]):
    """Every key, over the main screen."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        # A scrolling box: at 80x24 the keys do not fit (↑ ↓ pgup pgdn scroll them).
        with VerticalScroll(id="help-box"):
            yield Static(key_table(self.app.size.width), id="help-keys")
            yield Static("esc, ? or q closes this; ↑ ↓ scroll", id="help-hint")

    def on_mount(self) -> None:
        box = self.query_one("#help-box")
        box.border_title = "schedtop keys"
        box.focus()
