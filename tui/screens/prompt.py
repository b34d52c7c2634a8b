"""One-line dialogs: go to a step or time, and edit the breakpoints."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from replays.breakpoints import Predicate, parse
from tui.format import parse_goto

T = TypeVar("T")

BREAKPOINT_HELP = (
    "comma-separated; empty clears them all:\n"
    "  preempt  preempt:ID  admit:ID  first-token:ID  finish:ID\n"
    "  free<N (blocks)  slow>MS (a step)  wait>STEPS (queued)  util<PERCENT"
)
GOTO_HELP = "a step (120), a move (+10, -10), or a time since the start (1.5s, 250ms); g: the first"
FIRST_STEP = ("edge", 0)  # `gg`, as in vim: the go-to dialog's answer for the first step


class PromptScreen(ModalScreen[T | None], Generic[T]):
    """An input line whose text `parse` turns into the result (ValueError: shown, and
    the dialog stays open). Escape cancels."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(
        self,
        title: str,
        hint: str,
        parse: Callable[[str], T],
        value: str = "",
        shortcuts: dict[str, T] | None = None,
    ) -> None:
        super().__init__()
        self._title, self._hint, self._parse, self._value = title, hint, parse, value
        self._shortcuts = shortcuts or {}  # a whole input that answers at once (no enter)

    def compose(self) -> ComposeResult:
        with Vertical(classes="prompt-box"):
            yield Input(self._value, id="prompt-input")
            yield Static(self._hint, id="prompt-hint")
            yield Static("", id="prompt-error")

    def on_mount(self) -> None:
        self.query_one(".prompt-box").border_title = self._title
        self.query_one(Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.value in self._shortcuts:
            event.stop()
            self.dismiss(self._shortcuts[event.value])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            result = self._parse(event.value)
        except ValueError as e:
            self.query_one("#prompt-error", Static).update(str(e))
            return
        self.dismiss(result)

    def action_cancel(self) -> None:
        self.dismiss(None)


def goto_screen() -> PromptScreen[tuple[str, int]]:
    return PromptScreen("go to", GOTO_HELP, parse_goto, shortcuts={"g": FIRST_STEP})


def parse_breakpoints(text: str) -> tuple[Predicate, ...]:
    """Comma-separated breakpoints; the first bad one's ValueError."""
    return tuple(parse(part) for part in text.split(",") if part.strip())


def breakpoints_screen(current: tuple[str, ...]) -> PromptScreen[tuple[Predicate, ...]]:
    return PromptScreen("breakpoints", BREAKPOINT_HELP, parse_breakpoints, ", ".join(current))
