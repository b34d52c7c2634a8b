"""The text summary `schedtop sim` prints."""

from __future__ import annotations

from engine.records import printable
from engine.sim.driver import SimSummary


def format_summary(s: SimSummary, max_rows: int = 40) -> str:
    finished = len(s.finish_step)
    errors = sum(1 for r in s.finish_reason.values() if r.split(":")[0] == "error")
    lines = [
        f"steps {s.num_steps}   requests {len(s.arrival_step)} (finished {finished}, "
        f"errors {errors})   scheduled tokens {s.scheduled_tokens}",
        f"preemptions {s.num_preemptions}   prefix-hit tokens {s.prefix_hit_tokens}",
        "",
        f"{'request':<12} {'arrive':>6} {'queued':>6} {'ttft':>5} {'finish':>6} "
        f"{'preempt':>7}  reason",
    ]
    rows = sorted(s.arrival_step, key=lambda r: (s.arrival_step[r], r))
    for rid in rows[:max_rows]:
        arrive = s.arrival_step[rid]
        first = s.first_scheduled.get(rid)
        token = s.first_token.get(rid)
        lines.append(
            f"{rid[:12]:<12} {arrive:>6} {_steps(first, arrive):>6} {_steps(token, arrive):>5} "
            f"{s.finish_step.get(rid, '-'):>6} {s.preemptions.get(rid, 0):>7}  "
            f"{s.finish_reason.get(rid, '-')}"
        )
    if len(rows) > max_rows:
        lines.append(f"... {len(rows) - max_rows} more")
    lines.append("(queued: steps from arrival to first scheduled; ttft: to first token)")
    return printable("\n".join(lines))


def _steps(step: int | None, arrive: int) -> str:
    return "-" if step is None else str(step - arrive)
