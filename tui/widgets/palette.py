"""Colours shared by the panes, so that a request has one colour everywhere: its table
swatch, its blocks in the map, its events."""

from __future__ import annotations

from functools import cache

from rich.color import Color
from rich.style import Style

# Distinct on dark and light terminals; a request's colour is OWNERS[ref % len(OWNERS)].
OWNERS = (
    "#e06c75",
    "#98c379",
    "#e5c07b",
    "#61afef",
    "#c678dd",
    "#56b6c2",
    "#d19a66",
    "#ff79c6",
    "#8be9fd",
    "#b8e986",
    "#f4a261",
    "#a29bfe",
)
NULL = "#3a3f4b"  # the null block 0
FREE = "#5c6370"  # a free block holding nothing
CACHED = "#4f86b8"  # a free block still holding a prefix hash (evictable)
SHARED = "#f0f0f0"  # a block in several tables
BACKGROUND = "#1e2127"  # what dimmed colours fade towards

KINDS = {"prefill": "#61afef", "chunk": "#56b6c2", "decode": "#98c379", "spec": "#c678dd"}
STATES = {
    "running": "#98c379",
    "waiting": "#e5c07b",
    "preempted": "#e06c75",
    "stopped": "#61afef",
    "length": "#61afef",
    "aborted": "#d19a66",
    "error": "#ff5555",
}
EVENTS = {
    "arrive": "#7f848e",
    "admit": "#98c379",
    "evict": "#56b6c2",
    "preempt": "#e06c75",
    "finish": "#61afef",
    "abort": "#d19a66",
    "break": "#c678dd",
    "note": "#e5c07b",
}
MODES = {"LIVE": "#98c379", "PAUSED": "#e5c07b", "PLAYING": "#56b6c2", "SEARCHING": "#c678dd"}


def owner(ref: int) -> str:
    """A request's colour."""
    return OWNERS[ref % len(OWNERS)]


@cache
def dim(colour: str, amount: float = 0.65) -> str:
    """`colour` faded towards the background (for blocks of requests not selected)."""
    c = Color.parse(colour).get_truecolor()
    b = Color.parse(BACKGROUND).get_truecolor()
    mix = [round(x + (y - x) * amount) for x, y in zip(c, b)]
    return "#{:02x}{:02x}{:02x}".format(*mix)


@cache
def style(
    fg: str | None = None,
    bg: str | None = None,
    *,
    bold: bool = False,
    reverse: bool = False,
    underline: bool = False,
) -> Style:
    """A cached Style: the block map asks for thousands per frame."""
    return Style(
        color=fg,
        bgcolor=bg,
        bold=bold or None,
        reverse=reverse or None,
        underline=underline or None,
    )
