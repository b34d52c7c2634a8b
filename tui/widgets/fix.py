"""The incidents view's fix section: a knob changed (`x`), the run again in the
background, and what it did per group and per request next to the recording. Text lines
from the state the app hands it; the app's worker did the reading."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.reactive import reactive

from replays.fix import FixOutcome
from tui.format import middle
from tui.widgets.lines import TextLines

_DIM = "#7f848e"
_GOOD, _BAD = "#98c379", "#e06c75"


def request_rows(height: int) -> int:
    """Request lines under the groups on a screen `height` lines tall: the preemptions
    table keeps the rest."""
    return 2 if height < 30 else 4


@dataclass(frozen=True, slots=True)
class FixState:
    """A fix being tried, or tried: its setting, then its outcome or why it failed."""

    setting: str
    outcome: FixOutcome | None = None  # None while it runs (or when it failed)
    error: str = ""  # why it could not be tried

    @property
    def running(self) -> bool:
        return self.outcome is None and not self.error


class FixSection(TextLines):
    """Nothing until a fix is tried; then a line on how it went and a line per group and
    per request: recorded → with the fix."""

    state: reactive[FixState | None] = reactive(None)

    def on_mount(self) -> None:
        self.display = self.state is not None  # no line at all until a fix is tried

    def watch_state(self) -> None:
        lines = len(self.lines(self.size.width, 0))
        self.display = lines > 0
        self.styles.height = max(1, lines)

    def lines(self, width: int, height: int) -> list[Text]:
        s = self.state
        if s is None:
            return []
        head = Text()
        head.append("fix ", style="bold #61afef")
        head.append(s.setting, style="bold")
        if s.error:
            head.append(f": {s.error}", style=_BAD)
            return [head]
        o = s.outcome
        if o is None:
            head.append(" · running in the background (esc leaves it running)", style="italic")
            return [head]
        unit = "steps" if o.unit != "s" else "s"
        head.append(f" · {o.how}, {unit}: recorded → with it · ", style=_DIM)
        head.append(
            "no decision changes"
            if o.first_difference is None
            else f"differs from step {o.first_difference}"
        )
        out = [head]
        for g in o.groups:
            t = Text(f"  {o.group_title} {g.key} ({g.requests}): ")
            t.append("TTFT p99 ")
            _change(t, g.ttft_p99, o.unit)
            t.append(" · queue p99 ")
            _change(t, g.queue_p99, o.unit)
            t.append(" · queue sum ")
            _change(t, g.queue_total, o.unit)
            out.append(t)
        for r in o.requests[: request_rows(self.app.size.height)]:
            t = Text(f"  {middle(r.request_id, 16):<16} queue ")
            _change(t, r.queue, o.unit)
            t.append(" · TTFT ")
            _change(t, r.ttft, o.unit)
            out.append(t)
        return out


def _v(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.0f}ms" if unit == "s" else f"{x:.0f}"


def _change(t: Text, pair: tuple[float | None, float | None], unit: str) -> None:
    a, b = pair
    t.append(f"{_v(a, unit)} → ")
    style = ""
    if a is not None and b is not None and a != b:
        style = _GOOD if b < a else _BAD
    t.append(_v(b, unit), style=style)
