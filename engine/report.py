"""What every step reports: the decisions and why, KV movements, outcomes and timings.

The engine fills one StepReport per step and hands it to its event sink. Everything the
recorder needs to rebuild the engine's state without an engine is here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.kv.events import KVEventLog
from engine.outputs import RunnerTimings
from engine.request import RequestStatus, SamplingParams


class Reason(enum.IntEnum):
    """Why a request was not scheduled this step, or got fewer tokens than it wanted."""

    TOKEN_BUDGET = 0  # the step's token budget ran out
    LONG_PREFILL_THRESHOLD = 1  # capped by long_prefill_token_threshold
    MAX_NUM_SEQS = 2  # running is full
    KV_BLOCKS = 3  # not enough free KV blocks
    WATERMARK = 4  # would fit, but not with the watermark kept free
    FULL_PROMPT = 5  # the chunk fits, the whole sequence does not (scheduler_reserve_full_isl)
    PREEMPTION = 6  # the waiting pass was skipped: this step preempted someone
    HEAD_OF_LINE = 7  # behind a waiting request that could not be admitted
    MAX_MODEL_LEN = 8  # at max_model_len
    PREEMPTED = 9  # preempted this step
    NO_CHUNKING = 10  # the prompt exceeds the budget and chunked prefill is off


class Kind(enum.IntEnum):
    """What a scheduled request's tokens are."""

    PREFILL = 0  # the rest of the prompt (or of a recompute), ending with a sample
    CHUNK = 1  # part of a prefill; no sample this step
    DECODE = 2  # one token after the last sampled one
    SPEC = 3  # one token plus draft tokens to verify


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request added before this step's schedule()."""

    request_id: str  # request id
    prompt_token_ids: list[int]  # the prompt
    prompt_block_hashes: list[bytes]  # hash of each full prompt block
    sampling_params: SamplingParams  # max_tokens, stop ids, ...
    priority: int  # lower runs first under the priority policy
    arrival_time: float  # the policy's tie-break order
    eos_token_id: int | None  # the model's EOS for this request (None: ignored)


@dataclass(slots=True)  # not frozen: built per request per step, and frozen is 4x slower
class Scheduled:
    """One request's share of the step, in scheduling order."""

    request_id: str  # request id
    num_tokens: int  # tokens computed this step
    kind: Kind  # prefill, chunk, decode or spec
    num_computed_before: int  # tokens already in the KV cache before this step
    num_spec_tokens: int = 0  # draft tokens among num_tokens


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request that entered running this step."""

    request_id: str  # request id
    cached_tokens: int  # prefix-cache hit tokens
    resumed: bool  # it had been preempted before


@dataclass(frozen=True, slots=True)
class Preemption:
    """A request preempted (recompute) so that another could get KV blocks."""

    victim: str  # the preempted request
    for_request: str  # the request whose allocation failed
    tokens_lost: int  # computed tokens thrown away
    unscheduled_tokens: int  # tokens it had been scheduled this step and gave back


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A request that got fewer tokens than it wanted (0 = not scheduled)."""

    request_id: str  # request id
    wanted: int  # tokens it could have computed
    got: int  # tokens it was scheduled
    reason: Reason  # why


@dataclass(frozen=True, slots=True)
class QueueStop:
    """Why a pass ended with requests left unscheduled, instead of a Shortfall each.

    `head` is the reason of the first request left (the waiting request whose allocation
    failed, say); `rest` that of every request after it in queue order."""

    head: Reason  # the first request left behind
    rest: Reason  # every request after it


@dataclass(frozen=True, slots=True)
class Finish:
    """A request that finished this step."""

    request_id: str  # request id
    status: RequestStatus  # which finished state
    message: str = ""  # for FINISHED_ERROR: what was wrong


@dataclass(slots=True)
class StepReport:
    """Everything one step decided and did."""

    step: int  # step index, from 0
    arrivals: list[Arrival]  # added before this step's schedule()
    scheduled: list[Scheduled]  # in scheduling order: running first, then admitted
    token_budget: int  # the step's budget
    admissions: list[Admission]  # entered running, in order
    preemptions: list[Preemption]  # in the order they happened
    shortfalls: list[Shortfall]  # requests cut short, each with its reason
    running_stop: QueueStop | None  # why the running pass left requests unscheduled
    waiting_stop: QueueStop | None  # why the waiting pass left requests in waiting
    num_leading_decodes: int = -1  # leading entries that are running[i] decoding 1 token (-1: ?)
    finishes: list[Finish] = field(default_factory=list)  # aborts and errors included
    sampled: dict[str, list[int]] = field(default_factory=dict)  # tokens appended per request
    sampled_flat: list[int] = field(default_factory=list)  # the same tokens, in sampled's order
    num_spec_accepted: dict[str, int] = field(default_factory=dict)  # accepted drafts
    num_spec_proposed: dict[str, int] = field(default_factory=dict)  # drafts for the next step
    kv_events: KVEventLog = field(default_factory=KVEventLog)  # every block movement, in order
    num_free_blocks_after_schedule: int = 0  # free blocks right after schedule()
    num_free_blocks: int = 0  # free blocks at the end of the step
    running: list[str] = field(default_factory=list)  # running queue at the end of the step
    waiting: list[str] = field(default_factory=list)  # waiting queue at the end of the step
    schedule_s: float = 0.0  # time in schedule()
    update_s: float = 0.0  # time in update_from_output()
    timings: list[RunnerTimings] = field(default_factory=list)  # runner timings resolved now

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)
