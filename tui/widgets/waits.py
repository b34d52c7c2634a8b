"""The incidents view's waits section: the longest waits before admission, with the
reason of most of their steps and the knob behind it, the waits per priority, the
head-of-line blockings named as such, and the shared prefix the prefix cache lost most
often. Text lines from the view model only."""

from __future__ import annotations

from collections import defaultdict

from rich.text import Text
from textual.reactive import reactive

from recorder.schema import printable
from replays.queueing import QueueWait
from tui.format import middle, short_id, si
from tui.incidents import IncidentsVM
from tui.widgets.lines import TextLines

NARROW = 90  # below this many columns a row leaves out the priority (the first line has it)


def rows_for(height: int) -> int:
    """Waits listed on a screen `height` lines tall: the preemptions table keeps the rest."""
    return 4 if height < 30 else 8 if height < 50 else 14


_DIM = "#7f848e"


class WaitsSection(TextLines):
    """A line of waits per priority (over the longest waits kept), the longest waits,
    then the longest head-of-line blocking and why its head could not get in."""

    vm: reactive[IncidentsVM | None] = reactive(None)

    def watch_vm(self) -> None:
        self._fit()

    def on_resize(self) -> None:
        self._fit()

    def _fit(self) -> None:
        height = len(self.lines(self.size.width, 0))
        if self.styles.height is None or self.styles.height.value != height:
            self.styles.height = height

    def lines(self, width: int, height: int) -> list[Text]:
        vm = self.vm
        if vm is None or not vm.waits:
            done = vm is not None and vm.done
            return [
                Text(
                    "waits before admission: none, every request got in the step it arrived"
                    if done
                    else "waits before admission: none so far (scanning)",
                    style=_DIM,
                ),
                *_cache_lines(vm),
            ]
        out = [_groups(vm), *_tenants(vm)]
        wide = width >= NARROW
        out.extend(_row(w, wide) for w in vm.waits[: rows_for(self.app.size.height)])
        for h in vm.head_of_line[:1]:
            t = Text()
            t.append("head-of-line ", style="bold #e06c75")
            t.append(short_id(h.request_id), style="bold")
            t.append(f" (prio {h.priority}) blocked {h.steps} steps from step {h.first_step}")
            t.append(f", held up {len(h.held)}: ")
            t.append(", ".join(short_id(r) for r in h.held[:3]) + (" …" if len(h.held) > 3 else ""))
            out.append(t)
            why = Text("  └ ")  # why the head could not get in, on a line of its own
            why.append(h.reason, style="#d19a66")
            if h.knob:
                why.append(f" → {h.knob}", style="#61afef")
            out.append(why)
        out.extend(_cache_lines(vm))
        return out


def _cache_lines(vm: IncidentsVM | None) -> list[Text]:
    """The shared prefix the cache lost most often (and how many more it lost), then on
    a line of its own how little of it was found and the knob that keeps more cached."""
    if vm is None or not vm.cache_losses:
        return []
    c = vm.cache_losses[0]
    t = Text()
    t.append("prefix cache lost ", style="bold #e06c75")
    t.append(f"{short_id(c.first)}'s prefix", style="bold")
    t.append(f" {c.losses} of {c.sharers} times from step {c.first_loss_step} ")
    t.append(f"({short_id(c.first_loss)})")
    more = len(vm.cache_losses) - 1
    if more:
        t.append(f", {more} more {'prefix' if more == 1 else 'prefixes'} lost", style=_DIM)
    why = Text("  └ ")
    why.append(f"{c.hit_rate:.0%} of {si(c.shared_tokens)} shared tokens hit", style="#d19a66")
    why.append(f" → {c.knob}", style="#61afef")
    return [t, why]


def _groups(vm: IncidentsVM) -> Text:
    """`waits · prio 0: 6, longest 31 · prio 5: 1, longest 36`, best priority first."""
    by: dict[int, list[int]] = defaultdict(list)
    for w in vm.waits:
        by[w.priority].append(w.steps)
    t = Text()
    t.append("waits before admission", style="bold #e5c07b")
    t.append(" · longest first", style=_DIM)
    for prio in sorted(by):
        steps = by[prio]
        t.append(f" · prio {prio}: {len(steps)}, longest {max(steps)}")
    return t


def _tenants(vm: IncidentsVM) -> list[Text]:
    """`by tenant · batch: 3, longest 36 · chat: 5, longest 31`, when arrivals recorded
    tenants (a workload's `tenant`, a client's `user`); most waits first."""
    by: dict[str, list[int]] = defaultdict(list)
    for w in vm.waits:
        if w.tenant is not None:
            by[w.tenant].append(w.steps)
    if not by:
        return []
    t = Text("by tenant", style=_DIM)
    for tenant in sorted(by, key=lambda k: (-len(by[k]), k)):
        steps = by[tenant]
        t.append(f" · {printable(tenant)}: {len(steps)}, longest {max(steps)}")
    return [t]


def _row(w: QueueWait, wide: bool) -> Text:
    t = Text()
    t.append(f"{si(w.steps) + ('+' if w.still else ''):>4} ", style="bold")
    if wide:
        t.append(f"p{w.priority:<2} ", style=_DIM)
    t.append(f"{middle(w.request_id, 16):<16} ")
    if w.inverted:  # first: it is what the row is about
        t.append("priority inversion: ", style="bold #e06c75")
    t.append(w.reason, style="#d19a66")
    if w.knob:
        t.append(f" → {w.knob}", style="#61afef")
    if w.held_by:
        t.append(f" by {short_id(w.held_by)}")
    return t
