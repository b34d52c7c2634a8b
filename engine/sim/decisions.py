"""The fidelity decision format: one JSON object per step, as vLLM's oracle writes it."""

from __future__ import annotations

from typing import Any

from engine.core import EngineCore, StepResult
from engine.records import FINISH_REASONS


def decision_record(result: StepResult, engine: EngineCore) -> dict[str, Any]:
    """The step's decisions in the oracle's field names and orders."""
    rep, names = result.report, result.names
    sched = engine.scheduler
    return {
        "step": rep.step,
        "arrived": [a.request_id for a in rep.arrivals],
        "scheduled": {names[s.ref]: s.num_tokens for s in rep.scheduled},
        "total_scheduled": rep.num_scheduled_tokens,
        "preempted": [names[p.victim] for p in rep.preemptions],
        "preemptions": [[names[p.victim], names[p.for_request]] for p in rep.preemptions],
        "admitted": {
            names[a.ref]: {"cached_tokens": a.cached_tokens, "resumed": a.resumed}
            for a in rep.admissions
        },
        "sampled": {rid: toks[-1] for rid, toks in result.sampled().items()},
        "finished": [names[f.ref] for f in rep.finishes],
        "finish_reasons": {names[f.ref]: FINISH_REASONS[f.status] for f in rep.finishes},
        "num_free_blocks": rep.free_blocks,
        "num_free_blocks_after_schedule": rep.free_blocks_after_schedule,
        "running": [names[r] for r in rep.running or ()],
        "waiting": [names[r] for r in rep.waiting or ()],
        "num_computed_tokens": {rid: r.num_computed_tokens for rid, r in sched.requests.items()},
        "block_tables": {
            rid: ids for rid in sched.requests if (ids := sched.kv.get_block_ids(rid))
        },
    }
