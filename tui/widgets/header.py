"""The two header lines: where the cursor is and how the engine is doing."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tui.format import clock, duration, short_id, si
from tui.viewmodel import HeaderVM
from tui.widgets import palette
from tui.widgets.lines import TextLines

_SEP = (" │ ", "#5c6370")


class StepHeader(TextLines):
    """Step, time, budget, queues, free blocks, throughput, mode and breakpoints; a
    server's HTTP counters and the followed request's client timings on lines of their
    own (at 80 columns neither fits after the queues)."""

    DEFAULT_CSS = """
    StepHeader { height: 2; padding: 0 1; background: $panel; }
    """

    vm: reactive[HeaderVM | None] = reactive(None)

    def watch_vm(self, vm: HeaderVM | None) -> None:
        height = 2 if vm is None else 2 + bool(vm.http) + bool(vm.followed and vm.client)
        if self.styles.height is None or self.styles.height.value != height:
            self.styles.height = height

    def lines(self, width: int, height: int) -> list[Text]:
        vm = self.vm
        if vm is None:
            return [Text("schedtop: opening the trace...", style="italic")]
        out = [_line_one(vm), _line_two(vm)]
        if vm.http:
            t = Text(vm.http)
            if vm.window:
                t.append(f" ({vm.window})", style="#7f848e")
            out.append(t)
        if vm.followed and vm.client:
            t = Text("▶ ", style="bold")  # the followed request, as the table marks it
            t.append(short_id(vm.followed), style="bold underline")
            t.append(f"  {vm.client}", style="#7f848e")
            out.append(t)
        return out


def _line_one(vm: HeaderVM) -> Text:
    # What matters most comes first, so that a narrow terminal cuts the rest: the mode,
    # the step, the time; the trace's name last.
    t = Text(no_wrap=True, overflow="ellipsis")
    mode = vm.mode
    t.append(f" {mode} ", style=f"bold #1e2127 on {palette.MODES.get(mode, '#abb2bf')}")
    if mode == "PLAYING":
        t.append(f" {vm.speed:g} steps/s")
    if mode == "SEARCHING" and vm.search_at is not None:
        t.append(f" at step {vm.search_at:,} (esc stops)")
    if vm.link:  # live over HTTP: the connection, not the file, says what is going on
        t.append(" ")
        t.append(f" {vm.link} ", style=f"bold #1e2127 on {_link_colour(vm.link)}")
    elif vm.live and vm.ended:
        t.append(" trace ended", style="#7f848e")
    elif vm.idle_s:
        t.append(f" no new step for {vm.idle_s:.0f} s", style="#d19a66")
    t.append(*_SEP)
    if vm.step < vm.first_step:
        t.append("no steps yet", style="italic")
    else:
        t.append("step ")
        t.append(f"{vm.step:,}", style="bold #ffffff")
        t.append(f" / {vm.last_step:,}")
        t.append(*_SEP)
        t.append(f"t {clock(vm.time_ns)}")
        if vm.step_ns:
            t.append(f"  (step {duration(vm.step_ns)})", style="#7f848e")
    if vm.breakpoints:
        t.append(*_SEP)
        t.append("● ", style="bold #e06c75")
        t.append(", ".join(vm.breakpoints))
    t.append(*_SEP)
    t.append("schedtop ", style="bold")
    t.append(vm.trace, style="#abb2bf")
    return t


def _line_two(vm: HeaderVM) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("free ")
    low = vm.usable_blocks and vm.free_blocks < 0.05 * vm.usable_blocks
    t.append(str(vm.free_blocks), style="bold #e06c75" if low else "bold")
    t.append(f" / {vm.usable_blocks}")
    t.append(*_SEP)
    used, budget = vm.budget_used, vm.budget
    t.append("budget ")
    t.append(f"{used}/{budget}", style="bold")
    if budget:
        t.append(" ")
        t.append_text(_gauge(used / budget, 10))
    t.append(*_SEP)
    t.append("running ")
    t.append(str(vm.running), style=f"bold {palette.STATES['running']}")
    if vm.max_num_seqs:
        t.append(f"/{vm.max_num_seqs}")
    t.append("  waiting ")
    t.append(str(vm.waiting), style=f"bold {palette.STATES['waiting']}")
    rate = vm.tokens_per_s
    if rate is not None:  # none for a simulated trace: its rate says nothing of a model
        t.append(*_SEP)
        t.append(si(rate), style="bold")
        t.append(" tok/s")
    if vm.followed and not vm.client:  # else it starts the client's own line
        t.append(*_SEP)
        t.append("following ", style="#7f848e")
        t.append(short_id(vm.followed), style="bold underline")
    return t


def _link_colour(link: str) -> str:
    if link.startswith("CONNECTED"):
        return "#98c379"
    if link.startswith("IDLE"):
        return "#e5c07b"
    return "#e06c75"  # DISCONNECTED, CONNECTING


def _gauge(fraction: float, width: int) -> Text:
    """A small bar: eighths of a cell, green to red as it fills."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    bar = "█" * full + (" ▏▎▍▌▋▊▉"[part] if part else "")
    colour = "#98c379" if fraction < 0.75 else "#e5c07b" if fraction < 0.95 else "#e06c75"
    return Text(bar.ljust(width), style=f"{colour} on #2c313a")
