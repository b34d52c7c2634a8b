"""The text summary `schedtop sim` prints."""

from __future__ import annotations

from engine.records import printable
from engine.sim.driver import SimSummary

ID_MAX = 44  # an OpenAI id (chatcmpl- and 32 hex digits) whole; longer ones cut in the middle


def format_summary(s: SimSummary, max_rows: int | None = 40) -> str:
    """The summary: totals, then a row per request in arrival order (the first `max_rows`;
    None: all), ids as wide as the longest (they differ at their end: never cut there)."""
    finished = len(s.finish_step)
    errors = sum(1 for r in s.finish_reason.values() if r.split(":")[0] == "error")
    lines = [
        f"steps {s.num_steps}   requests {len(s.arrival_step)} (finished {finished}, "
        f"errors {errors})   scheduled tokens {s.scheduled_tokens}",
        f"preemptions {s.num_preemptions}   prefix-hit tokens {s.prefix_hit_tokens}",
        "",
    ]
    rows = sorted(s.arrival_step, key=lambda r: (s.arrival_step[r], r))
    w = min(max((len(r) for r in rows), default=0), ID_MAX)
    w = max(w, 7)
    lines.append(
        f"{'request':<{w}} {'arrive':>6} {'queued':>6} {'ttft':>5} {'finish':>6} "
        f"{'preempt':>7}  reason"
    )
    shown = rows if max_rows is None else rows[:max_rows]
    for rid in shown:
        arrive = s.arrival_step[rid]
        first = s.first_scheduled.get(rid)
        token = s.first_token.get(rid)
        lines.append(
            f"{_middle(rid, w):<{w}} {arrive:>6} {_steps(first, arrive):>6} "
            f"{_steps(token, arrive):>5} "
            f"{s.finish_step.get(rid, '-'):>6} {s.preemptions.get(rid, 0):>7}  "
            f"{s.finish_reason.get(rid, '-')}"
        )
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more (--all lists every request)")
    lines.append("(queued: steps from arrival to first scheduled; ttft: to first token)")
    return printable("\n".join(lines))


def _middle(rid: str, width: int) -> str:
    """An id in `width` characters: both ends kept, an ellipsis between."""
    if len(rid) <= width:
        return rid
    head = (width - 1) // 2
    return rid[:head] + "…" + rid[len(rid) - (width - 1 - head) :]


def _steps(step: int | None, arrive: int) -> str:
    return "-" if step is None else str(step - arrive)
