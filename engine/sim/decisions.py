"""The fidelity decision format: one JSON object per step, as vLLM's oracle writes it."""

from __future__ import annotations

from typing import Any

from engine.core import EngineCore, StepResult
from engine.request import FINISH_REASONS


def decision_record(result: StepResult, engine: EngineCore) -> dict[str, Any]:
    """The step's decisions in the oracle's field names and orders."""
    rep = result.report
    sched = engine.scheduler
    finished = [f.request_id for f in rep.finishes]
    return {
        "step": rep.step,
        "arrived": [a.request_id for a in rep.arrivals],
        "scheduled": {s.request_id: s.num_tokens for s in rep.scheduled},
        "total_scheduled": rep.num_scheduled_tokens,
        "preempted": [p.victim for p in rep.preemptions],
        "preemptions": [[p.victim, p.for_request] for p in rep.preemptions],
        "admitted": {
            a.request_id: {"cached_tokens": a.cached_tokens, "resumed": a.resumed}
            for a in rep.admissions
        },
        "sampled": {rid: toks[-1] for rid, toks in rep.sampled.items()},
        "finished": finished,
        "finish_reasons": {f.request_id: FINISH_REASONS[f.status] for f in rep.finishes},
        "num_free_blocks": rep.num_free_blocks,
        "num_free_blocks_after_schedule": rep.num_free_blocks_after_schedule,
        "running": rep.running,
        "waiting": rep.waiting,
        "num_computed_tokens": {rid: r.num_computed_tokens for rid, r in sched.requests.items()},
        "block_tables": {
            rid: ids for rid in sched.requests if (ids := sched.kv.get_block_ids(rid))
        },
    }
