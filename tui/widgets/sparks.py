"""Sparklines of recent steps, with the cursor's column marked."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.reactive import reactive

from tui.viewmodel import Series, SparksVM
from tui.widgets.lines import StepClicked, TextLines

_BARS = " ▁▂▃▄▅▆▇█"
_LABEL = 12
_VALUE = 9
_COLOURS = ("#98c379", "#e5c07b", "#61afef", "#d19a66", "#e06c75", "#56b6c2")


class Sparklines(TextLines):
    """One line per series: its name, its recent values, and the value at the cursor."""

    DEFAULT_CSS = """
    Sparklines { height: auto; min-height: 6; }
    """

    vm: reactive[SparksVM | None] = reactive(None)

    def on_click(self, event: events.Click) -> None:
        """A click on a column goes to its step."""
        at = event.get_content_offset(self)
        vm = self.vm
        if at is None or vm is None or not vm.series:
            return
        n = len(vm.series[0].values)
        lo, hi = window(n, vm.cursor, max(1, self.size.width - _LABEL - _VALUE))
        column = at.x - _LABEL
        if 0 <= column < hi - lo:
            self.post_message(StepClicked(vm.first + lo + column))

    def drawn(self) -> tuple[int, int] | None:
        """The first and last step of the columns drawn at the pane's width."""
        vm = self.vm
        if vm is None or not vm.series or not vm.series[0].values:
            return None
        n = len(vm.series[0].values)
        lo, hi = window(n, vm.cursor, max(1, self.size.width - _LABEL - _VALUE))
        return vm.first + lo, vm.first + hi - 1

    def lines(self, width: int, height: int) -> list[Text]:
        vm = self.vm
        if vm is None:
            return []
        bars = max(1, width - _LABEL - _VALUE)
        return [_line(s, vm.cursor, bars, colour) for s, colour in zip(vm.series, _COLOURS)]


def window(n: int, cursor: int, width: int) -> tuple[int, int]:
    """The slice [lo, hi) of n values to show in `width` columns, keeping the cursor
    centred when it can be (at the right end when it is the last value)."""
    if n <= width:
        return 0, n
    if cursor < 0:
        return n - width, n
    lo = min(max(cursor - width // 2, 0), n - width)
    return lo, lo + width


def _line(series: Series, cursor: int, width: int, colour: str) -> Text:
    values = series.values
    lo, hi = window(len(values), cursor, width)
    shown = values[lo:hi]
    top = max(shown, default=0.0)
    t = Text(no_wrap=True)
    t.append(series.name[: _LABEL - 1].ljust(_LABEL), style="#abb2bf")
    for i, v in enumerate(shown):
        level = 0 if top <= 0 else round(v / top * (len(_BARS) - 1))
        char = _BARS[level] if v > 0 or top <= 0 else " "
        if lo + i == cursor:
            t.append(char if char != " " else "▁", style="bold #ffffff on #5c6370")
        else:
            t.append(char, style=colour)
    t.append(" " * (width - len(shown)))
    at = values[cursor] if 0 <= cursor < len(values) else None
    t.append(_value(at, series.unit).rjust(_VALUE), style="bold")
    return t


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "ms":
        return f"{v:.2f} ms" if v < 100 else f"{v:.0f} ms"
    if unit == "%":
        return f"{v:.0f}%"
    return f"{v:.0f}"
