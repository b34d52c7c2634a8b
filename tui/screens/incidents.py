"""The `i` screen: the longest waits before admission and head-of-line blocking, then
every preemption of the trace (or every abort and error), sortable and filterable, thrash
flagged; enter goes to the incident's step with its request selected."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Input

from replays.fix import suggest
from replays.storms import SORTS, THRASH_STEPS, Incident, IncidentKind, select
from tui.format import short_id
from tui.incidents import IncidentsVM
from tui.screens.prompt import PromptScreen
from tui.widgets.fix import FixSection, FixState
from tui.widgets.incidents import IncidentTable
from tui.widgets.lines import TextLines
from tui.widgets.waits import WaitsSection, rows_for

NUMERIC = frozenset(("lost", "free", "count"))  # sorted largest first on the first press
HINT = "enter go to step  x try a fix  e aborts/errors  t thrash  s/S sort  / filter  esc back"
FIX_HINT = (
    "KNOB=VALUE, as resim --set takes it: re-simulated (a timed trace: predicted with whatif)\n"
    "in the background, then compared per priority and for the longest waits"
)


def parse_setting(text: str) -> str:
    """`KNOB=VALUE`, checked for its shape here; the run checks the knob and the value."""
    key, eq, value = text.strip().partition("=")
    if not eq or not key.strip() or not value.strip():
        raise ValueError("KNOB=VALUE, e.g. watermark=0.1")
    return f"{key.strip()}={value.strip()}"


class IncidentSummary(TextLines):
    """Two lines: the storm in numbers, and what the list below shows."""

    vm: reactive[IncidentsVM | None] = reactive(None)
    showing: reactive[str] = reactive("")

    def lines(self, width: int, height: int) -> list[Text]:
        vm = self.vm
        if vm is None:
            return [Text("incidents: scanning the trace...", style="italic")]
        s = vm.summary
        one = Text()
        one.append(f"{s.preemptions:,} preemptions", style="bold #e06c75")
        one.append(f" in {s.steps:,} steps ({s.per_1k_steps:.1f} per 1k) · ")
        one.append(f"thrash {s.thrash}", style="bold #e5c07b")
        one.append(f" · aborts {s.aborts} · errors {s.errors}")
        if vm.window:  # a live view over a stream counts from when it attached
            one.append(f" ({vm.window})", style="#7f848e")
        if vm.error:
            one.append(f"  {vm.error}", style="bold #e06c75")
        elif vm.scanned_to < vm.last_step or not vm.done:
            one.append(
                f"  scanning: step {vm.scanned_to:,} of {vm.last_step:,}", style="italic #d19a66"
            )
        two = Text()
        two.append(f"recompute {s.lost_share:.1%}", style="bold")
        two.append(" of computed tokens · top victims ")
        two.append(", ".join(f"{short_id(rid)} ×{n}" for rid, n in s.top_victims) or "none")
        three = Text(self.showing, style="#e5c07b")
        return [one, two, three]


class Hint(TextLines):
    """The keys of this screen, on its last line."""

    def lines(self, width: int, height: int) -> list[Text]:
        return [Text(HINT, style="#7f848e")]


class IncidentsScreen(Screen[Incident | None]):
    """Incidents over the whole screen; dismissed with the chosen one (None: esc)."""

    BINDINGS = [
        Binding("escape,i", "back", "back"),
        Binding("e", "kinds", "aborts/errors"),
        Binding("t", "thrash", "thrash only"),
        Binding("s", "sort", "sort"),
        Binding("S", "sort_reverse", "reverse"),
        Binding("slash", "filter", "filter"),
        Binding("x", "fix", "try a fix"),
        Binding("question_mark", "app.help", "help"),
        Binding("q", "app.quit", "quit"),
    ]

    vm: reactive[IncidentsVM | None] = reactive(None)
    failures: reactive[bool] = reactive(False)  # aborts and errors instead of preemptions
    thrash_only: reactive[bool] = reactive(False)
    words: reactive[str] = reactive("")  # the filter
    sort_key: reactive[str] = reactive("step")
    sort_reverse: reactive[bool] = reactive(False)
    fix: reactive[FixState | None] = reactive(None)  # the fix tried last (the app sets it)

    class TryFix(Message):
        """The user asked for a run with `setting`; `about`: the requests to compare."""

        def __init__(self, setting: str, about: tuple[str, ...]) -> None:
            super().__init__()
            self.setting = setting
            self.about = about

    def __init__(
        self,
        vm: IncidentsVM | None,
        config: dict[str, object] | None = None,
        fix: FixState | None = None,
    ) -> None:
        super().__init__()
        self._initial = vm
        self._config = config or {}  # the recorded config: the first value a fix tries
        self._fix = fix

    def compose(self) -> ComposeResult:
        yield IncidentSummary(id="incident-summary")
        yield WaitsSection(id="incident-waits")
        yield FixSection(id="incident-fix")
        yield Input(placeholder="filter: words in the request, the cause or the flag", id="ifilter")
        yield IncidentTable(id="incident-table")
        yield Hint(id="incident-hint")

    def on_mount(self) -> None:
        self.query_one("#ifilter", Input).display = False
        self.query_one(IncidentTable).focus()
        self.vm = self._initial
        self.fix = self._fix

    def watch_fix(self) -> None:
        self.query_one(FixSection).state = self.fix

    def _refresh_rows(self) -> None:
        vm = self.vm
        table = self.query_one(IncidentTable)
        kinds = (
            (IncidentKind.ABORT, IncidentKind.ERROR) if self.failures else (IncidentKind.PREEMPT,)
        )
        query = f"{self.words} thrash" if self.thrash_only else self.words
        items = () if vm is None else vm.items
        rows = select(items, kinds, query, self.sort_key, self.sort_reverse)
        table.sort = (self.sort_key, self.sort_reverse)
        table.rows = rows
        what = "aborts and errors" if self.failures else "preemptions"
        total = sum(1 for i in items if i.kind in kinds)
        shown = f"{len(rows):,} of {total:,}" if len(rows) != total else f"{total:,}"
        parts = [f"{shown} {what}"]
        if self.thrash_only:
            parts.append(f"thrash only (again within {THRASH_STEPS} steps, or 3+ times)")
        if self.words:
            parts.append(f"filter: {self.words}")
        parts.append(f"sorted by {self.sort_key}{' ▼' if self.sort_reverse else ''}")
        summary = self.query_one(IncidentSummary)
        summary.vm = vm
        self.query_one(WaitsSection).vm = vm
        summary.showing = " · ".join(parts)

    def watch_vm(self) -> None:
        self._refresh_rows()

    # Every filter and sort setting changes only which rows show, in what order.
    watch_failures = watch_thrash_only = watch_words = watch_vm
    watch_sort_key = watch_sort_reverse = watch_vm

    def on_incident_table_chosen(self, message: IncidentTable.Chosen) -> None:
        self.dismiss(message.incident)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.words = event.value

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(IncidentTable).focus()
        if not event.value:
            event.input.display = False

    def action_back(self) -> None:
        box = self.query_one("#ifilter", Input)
        if box.has_focus or self.words:
            box.value = ""
            box.display = False
            self.query_one(IncidentTable).focus()
            return
        self.dismiss(None)

    def action_kinds(self) -> None:
        self.failures = not self.failures

    def action_thrash(self) -> None:
        self.thrash_only = not self.thrash_only

    def action_sort(self) -> None:
        key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        self.set_reactive(IncidentsScreen.sort_reverse, key in NUMERIC)  # one refresh
        self.sort_key = key

    def action_sort_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse

    def action_fix(self) -> None:
        """Ask for KNOB=VALUE (the knob of the longest wait's reason offered), then let the
        app run it in the background."""
        vm = self.vm
        knob = ""
        about: list[str] = []
        if vm is not None:
            shown = vm.waits[: rows_for(self.app.size.height)]
            about = [w.request_id for w in shown]
            found = [w.knob for w in shown if w.knob] + [h.knob for h in vm.head_of_line if h.knob]
            knob = found[0].split("/")[0] if found else ""
            if vm.head_of_line and vm.head_of_line[0].request_id not in about:
                about.append(vm.head_of_line[0].request_id)
        value = suggest(knob, self._config)

        def chosen(setting: str | None) -> None:
            if setting:
                self.post_message(self.TryFix(setting, tuple(about)))

        self.app.push_screen(PromptScreen("try a fix", FIX_HINT, parse_setting, value), chosen)

    def action_filter(self) -> None:
        box = self.query_one("#ifilter", Input)
        box.display = True
        box.focus()
