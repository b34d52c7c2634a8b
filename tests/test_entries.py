"""engine.records.Entries: a step's entries without one record per decode, read as the
tuple of Scheduled it stands for."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from engine.records import (
    Entries,
    Kind,
    Scheduled,
    entry_refs,
    entry_tokens,
    leading_decodes,
)


@dataclass
class _Req:
    ref: int


def _entries() -> tuple[Entries, tuple[Scheduled, ...]]:
    owners = [_Req(4), _Req(7), _Req(2), _Req(9)]
    before = [100, 37, 0, 12]
    chunk = Scheduled(2, 512, Kind.CHUNK, 0)
    spec = Scheduled(9, 3, Kind.SPEC, 12, 2)
    spelled = (
        Scheduled(4, 1, Kind.DECODE, 100),
        Scheduled(7, 1, Kind.DECODE, 37),
        chunk,
        spec,
    )
    return Entries(owners, before, {2: chunk, 3: spec}), spelled


def test_reads_as_the_tuple_it_stands_for() -> None:
    entries, spelled = _entries()
    assert len(entries) == 4 and bool(entries)
    assert tuple(entries) == spelled
    assert entries == spelled and spelled == entries  # both ways round
    assert entries[0] == spelled[0] and entries[-1] == spelled[-1]
    assert entries[1:] == spelled[1:] and entries[2:] == spelled[2:]
    assert repr(entries) == repr(spelled)
    assert entries != spelled[:3]


def test_slices_build_only_what_they_return() -> None:
    entries, spelled = _entries()
    assert entries[2:] == spelled[2:]
    assert entries._tuple is None  # the decodes before index 2 were never built


def test_columns_without_records() -> None:
    entries, spelled = _entries()
    assert entry_refs(entries) == (4, 7, 2, 9) == entry_refs(spelled)
    assert entry_tokens(entries) == 1 + 1 + 512 + 3 == entry_tokens(spelled)
    assert leading_decodes(entries) == 2 == leading_decodes(spelled)
    assert entries._tuple is None
    only_decodes = Entries([_Req(1), _Req(2)], [5, 6], {})
    assert leading_decodes(only_decodes) == 2 and only_decodes.num_explicit == 0
    assert leading_decodes(tuple(only_decodes)) == 2
    assert leading_decodes(Entries([], [], {})) == 0


def test_pickles_as_a_plain_tuple() -> None:
    entries, spelled = _entries()
    assert pickle.loads(pickle.dumps(entries)) == spelled
    assert type(pickle.loads(pickle.dumps(entries))) is tuple


def test_a_priority_preemption_takes_an_entry_back_and_the_rest_move_up() -> None:
    """Running [A, C, D]: A (lowest priority) decodes, C's prefill goes on in chunks (an
    explicit entry), D needs a block when none is free: A, scheduled already, is the
    victim, and C's entry moves up to where A's was."""
    from engine.config import EngineConfig
    from engine.outputs import ModelRunnerOutput
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler

    sched = Scheduler(
        EngineConfig(
            block_size=4,
            num_blocks=10,  # 9 usable
            max_num_batched_tokens=512,
            max_num_seqs=8,
            max_model_len=128,
            long_prefill_token_threshold=8,
            policy="priority",
            enable_prefix_caching=False,
            scheduler_reserve_full_isl=False,
        )
    )
    arrivals = {0: ("A", 3, 5), 1: ("C", 30, 0), 2: ("D", 4, 0)}
    decided = None
    for step in range(4):
        if step in arrivals:
            rid, n, prio = arrivals[step]
            prompt = [10 + step] * n
            sched.add_request(
                Request(rid, prompt, SamplingParams(max_tokens=50), float(step), prio)
            )
        out, decided = sched.schedule()
        reqs = sched.requests
        ids = list(out.num_scheduled_tokens)
        done = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]
        sched.update_from_output(out, ModelRunnerOutput(ids, done))
        sched.end_step()
    assert decided is not None
    a, c, d = 0, 1, 2  # refs, in arrival order
    assert [p.victim for p in decided.preemptions] == [a]
    assert tuple(decided.scheduled) == (
        Scheduled(c, 8, Kind.CHUNK, 16),
        Scheduled(d, 1, Kind.DECODE, 4),
    )
    assert entry_refs(decided.scheduled) == (c, d)
