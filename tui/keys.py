"""Every key, in one place: the help screen and docs/tui.md list these."""

from __future__ import annotations

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Moving",
        (
            ("space", "play / pause (live: pause, follow)"),
            ("+ / -", "play faster / slower"),
            ("→ / ←", "one step forwards / back"),
            ("shift+→ / ←", "ten steps"),
            ("home / end", "first / last step"),
            ("gg / G", "first / last step (vim)"),
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
            ("", "free<8 hits as it becomes true;"),
            ("", "while free<8: every step it holds"),
            ("esc", "stop a search, playing, filter"),
        ),
    ),
    (
        "Incidents (i)",
        (
            ("i", "longest waits, preemptions"),
            ("enter", "go to its step, select victim"),
            ("x", "try a fix: KNOB=VALUE, re-run"),
            ("e", "aborts and errors instead"),
            ("t", "thrash only"),
            ("s / S", "sort (numbers: largest first)"),
            ("/", "filter: request, cause, thrash"),
            ("esc / i", "back to the main screen"),
        ),
    ),
    (
        "Requests",
        (
            ("↑ / ↓, click", "select (its blocks light up)"),
            ("f", "follow it (again: stop)"),
            ("] / [", "its next / previous event"),
            ("j / k", "down / up (when the table has focus)"),
            ("/", "filter: id, state, reason, preempted"),
            ("", "pre>0, wait>50 compare counts"),
            ("s / S", "sort by next column / reverse"),
        ),
    ),
    (
        "KV block map",
        (
            ("click, jkhl", "select a block: owners, hash"),
            ("z", "zoom: 1, 2 per cell, aggregate"),
            ("esc", "deselect: the legend again"),
        ),
    ),
    (
        "Event log (tab to it)",
        (
            ("↑ / ↓, pgup/dn", "scroll (end: newest again)"),
            ("c", "kind: preempt, admit, finish, ..."),
            ("click", "go to the event's step"),
        ),
    ),
    (
        "Anywhere",
        (
            ("tab", "next pane (table, map, log)"),
            ("m", "maximize pane (again: back)"),
            ("?", "this help"),
            ("q", "quit"),
        ),
    ),
)
LEFT_SECTIONS = 3  # the help screen's left column: Moving, Breakpoints, Incidents
