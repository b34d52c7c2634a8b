"""Every key, in one place: the help screen and docs/tui.md list these."""

from __future__ import annotations

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Moving",
        (
            ("space", "play / pause (live: pause)"),
            ("+ / -", "play faster / slower"),
            ("→ / ←", "one step forwards / back"),
            ("shift+→ / ←", "ten steps"),
            ("home / end", "first / last step"),
            ("F / end", "live: follow the newest step"),
            ("g", "go to a step, +N/-N, or a time"),
            ("click", "go to a history column or event"),
        ),
    ),
    (
        "Breakpoints",
        (
            ("n / N", "next / previous hit"),
            ("b", "break on preemption (toggle)"),
            ("B", "edit: free<8, slow>50, admit:ID"),
            ("esc", "stop a search, playing, filter"),
        ),
    ),
    (
        "Requests",
        (
            ("↑ / ↓, click", "select (its blocks light up)"),
            ("f", "follow it (again: stop)"),
            ("] / [", "its next / previous event"),
            ("/", "filter: id, state, kind, reason"),
            ("s / S", "sort by next column / reverse"),
        ),
    ),
    (
        "KV block map",
        (
            ("click, jkhl", "select a block: owners, hash"),
            ("z", "zoom: 1, 2 per cell, aggregate"),
        ),
    ),
    (
        "Anywhere",
        (
            ("tab", "next pane"),
            ("?", "this help"),
            ("q", "quit"),
        ),
    ),
)
LEFT_SECTIONS = 2  # the help screen's left column: Moving and Breakpoints
