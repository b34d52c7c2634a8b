"""The step's batch against its token budget: one bar, totals per kind, the entries."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tui.viewmodel import BATCH_KINDS, BatchVM
from tui.widgets import palette
from tui.widgets.lines import TextLines

_UNUSED = "#3b4048"


class BatchBar(TextLines):
    """Prefill, chunk, decode and spec tokens per request, against the budget."""

    DEFAULT_CSS = """
    BatchBar { height: auto; min-height: 3; }
    """

    vm: reactive[BatchVM | None] = reactive(None)

    def lines(self, width: int, height: int) -> list[Text]:
        vm = self.vm
        if vm is None or not vm.budget:
            return [Text("no step yet", style="italic #7f848e")]
        width = max(10, width)
        return [bar(vm, width), _totals(vm), *_entries(vm, width, max(1, height - 2))]


def bar(vm: BatchVM, width: int) -> Text:
    """Each entry's share of the budget, in its kind's colour; adjacent entries alternate
    in shade so that one request's tokens stay apart from the next one's."""
    t = Text(no_wrap=True)
    scale = width / max(vm.budget, sum(e.tokens for e in vm.entries))
    done = 0.0
    drawn = 0
    for i, e in enumerate(vm.entries):
        # A verifying entry: its decode token, then its drafts in the spec colour.
        kind = "decode" if e.kind == "spec" else e.kind
        for k, tokens in ((kind, e.tokens - e.spec), ("spec", e.spec)):
            done += tokens * scale
            cells = round(done) - drawn
            if cells <= 0:
                continue
            colour = palette.KINDS.get(k, "#abb2bf")
            if i % 2:
                colour = palette.dim(colour, 0.3)
            t.append("█" * cells, style=colour)
            drawn += cells
    t.append("·" * (width - drawn), style=_UNUSED)
    return t


def _totals(vm: BatchVM) -> Text:
    """Tokens per kind (the kinds in the step only), and the budget used."""
    t = Text(no_wrap=True, overflow="ellipsis")
    totals = dict(vm.by_kind)
    used = sum(totals.values())
    t.append(f"{used}/{vm.budget} tokens", style="bold")
    t.append(f" ({100 * used / vm.budget:.0f}%)" if vm.budget else "")
    for kind in BATCH_KINDS:
        if totals.get(kind):
            t.append("  ■ ", style=palette.KINDS[kind])
            t.append(f"{kind} {totals[kind]}")
    return t


def _entries(vm: BatchVM, width: int, height: int) -> list[Text]:
    """The requests in the batch, as many lines as fit: the large entries by name,
    decodes as a count."""
    decodes = [e for e in vm.entries if e.kind == "decode"]
    others = sorted((e for e in vm.entries if e.kind != "decode"), key=lambda e: -e.tokens)
    parts: list[tuple[str, str]] = []
    if decodes:
        parts.append((f"{len(decodes)} decoding", palette.KINDS["decode"]))
    for e in others:
        spec = f" ({e.spec} draft{'s' if e.spec > 1 else ''}" if e.spec else ""
        if spec:
            spec += f", {e.accepted} accepted)" if e.accepted >= 0 else ")"
        parts.append((f"{e.request_id} {e.kind} {e.tokens}{spec}", palette.KINDS[e.kind]))
    lines: list[Text] = [Text()]
    for text, colour in parts:
        line = lines[-1]
        if line.cell_len and line.cell_len + 3 + len(text) > width:
            if len(lines) == height:
                break
            lines.append(Text())
            line = lines[-1]
        if line.cell_len:
            line.append(" · ", style="#5c6370")
        line.append(text, style=colour)
    return lines
