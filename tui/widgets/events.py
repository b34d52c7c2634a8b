"""The event log: admissions, preemptions, finishes and breakpoint hits up to the step."""

from __future__ import annotations

from rich.text import Text
from textual.events import Click
from textual.reactive import reactive

from tui.history import Event
from tui.widgets import palette
from tui.widgets.lines import StepClicked, TextLines

_TAGS = {
    "arrive": "arrive",
    "admit": "admit",
    "preempt": "PREEMPT",
    "finish": "finish",
    "break": "BREAK",
    "note": "note",
}


class EventLog(TextLines):
    """The newest events that fit, oldest at the top; the shown step's are marked."""

    DEFAULT_CSS = """
    EventLog { height: 1fr; }
    """

    events: reactive[tuple[Event, ...]] = reactive(())
    step: reactive[int] = reactive(-1)
    followed: reactive[str | None] = reactive(None)

    def on_click(self, event: Click) -> None:
        """A click on an event goes to its step."""
        at = event.get_content_offset(self)
        shown = self.events[-max(1, self.size.height) :]
        if at is not None and 0 <= at.y < len(shown):
            self.post_message(StepClicked(shown[at.y].step))

    def lines(self, width: int, height: int) -> list[Text]:
        shown = self.events[-max(1, height) :]
        if not shown:
            return [Text("no events in the steps before this one", style="italic #7f848e")]
        return [line(e, e.step == self.step, self.followed) for e in shown]


def line(e: Event, current: bool, followed: str | None) -> Text:
    """One log line: step, coloured tag, text."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("▶" if current else " ", style="bold #ffffff")
    t.append(f"{e.step:>7} ", style="bold" if current else "#7f848e")
    colour = palette.EVENTS.get(e.kind, "#abb2bf")
    t.append(f"{_TAGS.get(e.kind, e.kind):<8}", style=f"bold {colour}")
    mine = followed is not None and followed in e.requests
    t.append(e.text, style="bold underline" if mine else ("" if current else "#abb2bf"))
    return t
