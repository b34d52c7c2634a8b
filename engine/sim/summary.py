"""The text summary `schedtop sim` prints: engine.metrics' figures in steps, the same
fold and definitions as `schedtop stats` on the sim's trace (docs/metrics.md)."""

from __future__ import annotations

from engine.metrics import request_times, step_clock
from engine.records import printable
from engine.sim.driver import SimSummary

ID_MAX = 44  # an OpenAI id (chatcmpl- and 32 hex digits) whole; longer ones cut in the middle


def format_summary(s: SimSummary, max_rows: int | None = 40) -> str:
    """The summary: totals, then a row per request in arrival order (the first `max_rows`;
    None: all), ids as wide as the longest (they differ at their end: never cut there)."""
    m = s.metrics()
    errors = sum(1 for r in s.finish_reason.values() if r.split(":")[0] == "error")
    readmits = ""
    if m.readmit_query_tokens:
        readmits = f"; re-admissions {m.readmit_hit_tokens} of {m.readmit_query_tokens} tokens hit"
    lines = [
        f"steps {m.num_steps}   requests {len(s.arrival_step)} (finished {m.num_finished}, "
        f"errors {errors})   scheduled tokens {s.scheduled_tokens}",
        f"engine TTFT p50 {_p(m.ttft_p50)}  p99 {_p(m.ttft_p99)}   "
        f"TPOT p50 {_p(m.tpot_p50)}  p99 {_p(m.tpot_p99)}   (steps)",
        f"preemptions {m.preemptions}   prefix-hit rate {m.prefix_hit_rate:.1%} "
        f"({m.prefix_hit_tokens} of {m.prefix_query_tokens} tokens at first admissions"
        f"{readmits})",
        "",
    ]
    rows = sorted(s.arrival_step, key=lambda r: (s.arrival_step[r], r))
    w = min(max((len(r) for r in rows), default=0), ID_MAX)
    w = max(w, 7)
    lines.append(
        f"{'request':<{w}} {'arrive':>6} {'queued':>6} {'ttft':>5} {'finish':>6} "
        f"{'preempt':>7}  reason"
    )
    clock = step_clock(s.fold)
    lives = s.lives()
    shown = rows if max_rows is None else rows[:max_rows]
    for rid in shown:
        life = lives.get(rid)
        t = request_times(life, clock) if life is not None else None
        queued, ttft = (None, None) if t is None else (t.queue, t.ttft)
        finish = life.finish_step if life is not None and life.finish_step >= 0 else "-"
        lines.append(
            f"{_middle(rid, w):<{w}} {s.arrival_step[rid]:>6} {_n(queued):>6} "
            f"{_n(ttft):>5} {finish:>6} {life.preemptions if life else 0:>7}  "
            f"{s.finish_reason.get(rid, '-')}"
        )
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more (--all lists every request)")
    lines.append(
        "(queued: steps from arrival to first scheduled; ttft: steps to the first token, "
        "counting the step that sampled it)"
    )
    return printable("\n".join(lines))


def _middle(rid: str, width: int) -> str:
    """An id in `width` characters: both ends kept, an ellipsis between."""
    if len(rid) <= width:
        return rid
    head = (width - 1) // 2
    return rid[:head] + "…" + rid[len(rid) - (width - 1 - head) :]


def _p(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"
