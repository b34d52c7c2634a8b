"""A synthetic SGLang trace of format 1.9 (a token pool slot by slot), written without
SGLang: two requests prefill and decode, one finishes into the radix cache, a third hits
its prompt there (a shared prefix), the cache evicts a slot that a decode takes, and a
retraction gives a request's slots back. The reducer's and the TUI's tests read it."""

from __future__ import annotations

from pathlib import Path

from recorder.codec import encode
from recorder.schema import (
    Admission,
    Arrival,
    Finish,
    Header,
    Kind,
    Preemption,
    Reason,
    SamplingParams,
    Scheduled,
    SlotWrite,
    Status,
    Step,
)
from recorder.writer import TraceWriter


def header(slots: int, slot_map: bool = True) -> Header:
    return Header(
        engine="SGLang 0.5.23 (Scheduler)",
        model="tiny",
        config={"max_num_seqs": 8},
        block_size=1,
        num_blocks=slots + 1,
        policy="fcfs",
        start_time_ns=1,
        host="h",
        redacted=False,
        kv_pool="tokens",
        slot_map=slot_map,
    )


def _arrival(ref: int, prompt: int) -> Arrival:
    return Arrival(
        ref=ref,
        request_id=f"r{ref}",
        num_prompt_tokens=prompt,
        priority=0,
        arrival_time=float(ref),
        eos_token_id=None,
        sampling=SamplingParams(max_tokens=16, ignore_eos=True),
    )


def steps(slots: int, p: int = 8) -> list[Step]:
    """The story in the module's docstring, on a pool of `slots` slots with prompts of
    `p` tokens (`3 * p + 8` slots at most in use)."""
    n = slots + 1  # the padding slot 0 included
    blocks = dict(free_blocks=n - 1, free_blocks_after_schedule=n - 1)
    free = slots
    out: list[Step] = []
    # 0: r0 and r1 prefill p tokens each: slots 1..2p
    free -= 2 * p
    out.append(
        Step(
            step=0,
            arrivals=(_arrival(0, p), _arrival(1, p)),
            scheduled=(Scheduled(0, p, Kind.PREFILL, 0), Scheduled(1, p, Kind.PREFILL, 0)),
            admissions=(Admission(0, 0, False), Admission(1, 0, False)),
            sample_counts=(1, 1),
            slot_allocs=(1, 2 * p),
            free_slots=free,
            **blocks,
        )
    )
    # 1: both decode: r0 gets 2p+1, r1 2p+2
    free -= 2
    out.append(
        Step(
            step=1,
            scheduled=(Scheduled(0, 1, Kind.DECODE, p), Scheduled(1, 1, Kind.DECODE, p)),
            slot_allocs=(2 * p + 1, 2),
            free_slots=free,
            **blocks,
        )
    )
    # 2: r1 decodes (2p+3); r0 finishes: its p+1 slots stay in the radix cache, evictable
    free -= 1
    out.append(
        Step(
            step=2,
            scheduled=(Scheduled(1, 1, Kind.DECODE, p + 1),),
            finishes=(Finish(0, Status.FINISHED_LENGTH_CAPPED),),
            other_samples=(),
            slot_allocs=(2 * p + 3, 1),
            free_slots=free + p + 1,
            cached_slots=p + 1,
            evictable_slots=p + 1,
            **blocks,
        )
    )
    # 3: r2 arrives with r0's prompt and 4 more tokens: a radix hit on slots 1..p (no
    # longer evictable: r2 uses them), its 4 tokens on 2p+4..2p+7
    free -= 4
    out.append(
        Step(
            step=3,
            arrivals=(_arrival(2, p + 4),),
            scheduled=(Scheduled(2, 4, Kind.PREFILL, p),),
            admissions=(Admission(2, p, False),),
            slot_allocs=(2 * p + 4, 4),
            slot_writes=(SlotWrite(2, 0, (1, p)),),
            free_slots=free + 1,
            cached_slots=p + 1,
            evictable_slots=1,
            **blocks,
        )
    )
    # 4: the cache evicts r0's last slot (2p+1) and r1's decode takes it at once
    out.append(
        Step(
            step=4,
            scheduled=(Scheduled(2, 1, Kind.DECODE, p + 4), Scheduled(1, 1, Kind.DECODE, p + 2)),
            slots_freed_first=(2 * p + 1, 1),
            slot_allocs=(2 * p + 8, 1, 2 * p + 1, 1),
            free_slots=free - 1,
            cached_slots=p,
            evicted_slots=1,
            **blocks,
        )
    )
    free -= 1
    # 5: r1 is retracted: all p + 3 of its slots go back; r2 decodes into slot p+1
    free += p + 3 - 1
    out.append(
        Step(
            step=5,
            scheduled=(Scheduled(2, 1, Kind.DECODE, p + 5),),
            preemptions=(Preemption(1, 1, p + 3, cause=Reason.RETRACTED),),
            slots_freed_first=(p + 1, p, 2 * p + 2, 2, 2 * p + 1, 1),
            slot_allocs=(p + 1, 1),
            free_slots=free,
            cached_slots=p,
            running=(2,),
            waiting=(1,),
            **blocks,
        )
    )
    return out


def write(path: Path, slots: int, p: int = 8) -> Path:
    writer = TraceWriter(path, live=False)
    writer.append(*encode(header(slots)))
    for step in steps(slots, p):
        writer.append(*encode(step))
    writer.close()
    return path
