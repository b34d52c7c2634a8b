"""The trace's records: what a trace holds, independent of how it is encoded.

This module imports nothing from the engine, so that replays and the TUI can read traces
without it. Requests are named by their *ref*, the ordinal of their arrival in the trace
(0, 1, 2, ...): request ids may be reused once a request has finished, refs never are, and
they are small integers. Enum-valued fields hold plain ints (the enums below name them),
so that a reader can carry a value it does not know yet.

`docs/trace-format.md` is the specification; `recorder.codec` is its implementation.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

FORMAT_MAJOR = 1  # a reader refuses traces with a newer major version
FORMAT_MINOR = 1  # minor versions only add fields and record types, which readers skip
# 1.1: CLIENT records (schedtop serve)

Scalar = str | int | float | bool | None


class RecordType(enum.IntEnum):
    """The type tag in each record's frame."""

    HEADER = 1
    STEP = 2
    SNAPSHOT = 3
    FOOTER = 4
    END = 5
    CLIENT = 6  # since 1.1: an HTTP request as a server saw it (schedtop serve)


class Kind(enum.IntEnum):
    """What a scheduled request's tokens are (the engine's values)."""

    PREFILL = 0  # the rest of the prompt (or of a recompute), ending with a sample
    CHUNK = 1  # part of a prefill; no sample this step
    DECODE = 2  # exactly one token after the last sampled one
    SPEC = 3  # one token plus draft tokens to verify


class Reason(enum.IntEnum):
    """Why a request was not scheduled, or got fewer tokens than it wanted."""

    TOKEN_BUDGET = 0
    LONG_PREFILL_THRESHOLD = 1
    MAX_NUM_SEQS = 2
    KV_BLOCKS = 3
    WATERMARK = 4
    FULL_PROMPT = 5
    PREEMPTION = 6
    HEAD_OF_LINE = 7
    MAX_MODEL_LEN = 8
    PREEMPTED = 9
    NO_CHUNKING = 10


class Status(enum.IntEnum):
    """A request's lifecycle state; every value above PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6


class KVKind(enum.IntEnum):
    """A KV event's kind."""

    ALLOCATED = 0  # fresh blocks from the free-queue head appended to a request's table
    FREED = 1  # a request's whole table released, tail-first
    PREFIX_HIT = 2  # cached blocks appended to a request's table
    CACHED = 3  # full blocks got their hash
    EVICTED = 4  # free blocks handed out again lost their hash


# -- header ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Header:
    """The first record: what wrote the trace and how the engine was configured."""

    engine: str  # what wrote the trace, e.g. "schedtop 0.1.0 (SimRunner)"
    model: str  # model description; "" when there is none (simulated runs)
    config: dict[str, Scalar]  # the engine config, knob name -> value
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool, the null block 0 included
    policy: str  # "fcfs" or "priority": how the reducer orders the waiting queue
    start_time_ns: int  # wall clock (Unix ns) when recording started; masked in comparisons
    host: str  # the machine's name
    redacted: bool  # token ids replaced by lengths and block hashes
    first_step: int = 0  # the step of the first step record (> 0: attached mid-run)
    snapshot_interval: int = 256  # a snapshot follows step s when (s + 1) % interval == 0


# -- step -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling parameters."""

    max_tokens: int  # output tokens, at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept
    top_k: int = 0  # most likely tokens kept (0 = off)
    seed: int | None = None  # per-request generator seed
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request
    ignore_eos: bool = False  # keep going past the model's EOS


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request added before the step's schedule(); it gets the next ref."""

    ref: int  # the request's ref: the number of arrivals before it in the trace
    request_id: str  # the engine's request id
    num_prompt_tokens: int  # prompt length
    priority: int  # lower runs first under the priority policy
    arrival_time: float  # the policies' tie-break order
    eos_token_id: int | None  # the model's EOS for this request (None: ignored)
    sampling: Sampling  # max_tokens, stop ids, ...
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt; None when redacted
    prompt_block_hashes: tuple[bytes, ...] | None = None  # full prompt blocks; only if redacted


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One scheduled request beyond the step's leading decodes."""

    ref: int  # request
    num_tokens: int  # tokens computed this step
    kind: int  # a Kind
    num_computed_before: int  # tokens in the KV cache before this step
    num_spec_tokens: int = 0  # draft tokens among num_tokens


@dataclass(frozen=True, slots=True)
class Admission:
    """A waiting request that entered running."""

    ref: int  # request
    cached_tokens: int  # prefix-cache hit tokens
    resumed: bool  # it had been preempted before


@dataclass(frozen=True, slots=True)
class Preemption:
    """A request preempted (recompute) so that another could get KV blocks."""

    victim: int  # the preempted request
    for_request: int  # the request whose allocation failed (may be the victim)
    tokens_lost: int  # computed tokens thrown away
    unscheduled_tokens: int = 0  # tokens it had been scheduled this step and gave back


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A request that got fewer tokens than it wanted (0 = not scheduled)."""

    ref: int  # request
    wanted: int  # tokens it could have computed
    got: int  # tokens it was scheduled
    reason: int  # a Reason


@dataclass(frozen=True, slots=True)
class QueueStop:
    """Why a pass left requests unscheduled: the first one's reason, then the others'."""

    head: int  # a Reason: the first request left behind
    rest: int  # a Reason: every request after it


@dataclass(frozen=True, slots=True)
class Finish:
    """A request that finished this step (aborts and errors included)."""

    ref: int  # request
    status: int  # a finished Status
    message: str = ""  # for FINISHED_ERROR: what was wrong


@dataclass(frozen=True, slots=True)
class Sample:
    """Tokens sampled by a request that has no scheduled entry this step."""

    ref: int  # request
    count: int  # tokens appended
    token_ids: tuple[int, ...] | None = None  # the tokens; None when redacted


@dataclass(frozen=True, slots=True)
class SpecAccepted:
    """Draft tokens accepted for a speculative request; the rest were rolled back."""

    ref: int  # request
    accepted: int  # accepted drafts


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One KV movement; a step's events are in the order they happened."""

    kind: int  # a KVKind
    ref: int | None  # whose table changed; None for EVICTED
    block_ids: tuple[int, ...]  # in table order (FREED: in freeing order, tail first)
    hashes: tuple[bytes, ...] = ()  # CACHED: each block's new hash (EVICTED: the old ones)
    num_tokens: int = 0  # PREFIX_HIT only: tokens covered by the hit


@dataclass(frozen=True, slots=True)
class KVEvents:
    """A step's KV events, column by column: compact, and cheap to build and to apply.

    Event i has kind kinds[i] and sizes[i] blocks, the next ones in block_ids; every
    event but EVICTED takes the next ref in refs; CACHED events take their hashes from
    hashes, PREFIX_HIT events their token count from hit_tokens."""

    kinds: tuple[int, ...] = ()  # a KVKind per event, in the order they happened
    refs: tuple[int, ...] = ()  # the request of each event that is not EVICTED
    sizes: tuple[int, ...] = ()  # blocks per event
    block_ids: tuple[int, ...] = ()  # every event's blocks, back to back
    hashes: tuple[bytes, ...] = ()  # the new hash of every CACHED block, back to back
    hit_tokens: tuple[int, ...] = ()  # tokens covered by each PREFIX_HIT event

    def __len__(self) -> int:
        return len(self.kinds)

    def rows(self) -> Iterator[tuple[int, int | None, tuple[int, ...], tuple[bytes, ...], int]]:
        """(kind, ref, block_ids, hashes, num_tokens) per event, in order."""
        refs, hashes, hits = iter(self.refs), self.hashes, iter(self.hit_tokens)
        at = hashed = 0
        for kind, size in zip(self.kinds, self.sizes):
            blocks = self.block_ids[at : at + size]
            at += size
            if kind == KVKind.EVICTED:
                yield kind, None, blocks, (), 0
            elif kind == KVKind.CACHED:
                yield kind, next(refs), blocks, hashes[hashed : hashed + size], 0
                hashed += size
            elif kind == KVKind.PREFIX_HIT:
                yield kind, next(refs), blocks, (), next(hits)
            else:
                yield kind, next(refs), blocks, (), 0

    def events(self) -> tuple[KVEvent, ...]:
        """The events spelled out (EVICTED hashes are left empty: the state knows them)."""
        return tuple(KVEvent(*row) for row in self.rows())

    @classmethod
    def of(cls, events: Iterable[KVEvent]) -> KVEvents:
        kinds: list[int] = []
        refs: list[int] = []
        sizes: list[int] = []
        blocks: list[int] = []
        hashes: list[bytes] = []
        hits: list[int] = []
        for e in events:
            kinds.append(e.kind)
            sizes.append(len(e.block_ids))
            blocks += e.block_ids
            if e.kind != KVKind.EVICTED:
                assert e.ref is not None, "only EVICTED events have no request"
                refs.append(e.ref)
            if e.kind == KVKind.CACHED:
                hashes += e.hashes
            elif e.kind == KVKind.PREFIX_HIT:
                hits.append(e.num_tokens)
        return cls(
            tuple(kinds), tuple(refs), tuple(sizes), tuple(blocks), tuple(hashes), tuple(hits)
        )


NO_KV_EVENTS = KVEvents()


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel or operator of a profiled step."""

    name: str  # kernel or operator name
    calls: int  # launches in the step
    total_ns: int  # summed time


@dataclass(frozen=True, slots=True)
class Timing:
    """Where the runner's time went in one step (it may arrive a step late)."""

    step: int  # the step these timings measure
    prepare_ns: int  # building the input batch
    forward_ns: int  # the forward pass, attention included
    attention_ns: int | None  # attention alone, where measured
    sample_ns: int  # sampling
    kernels: tuple[Kernel, ...] = ()  # per-kernel breakdown on profiled steps


@dataclass(slots=True)  # not frozen: one per engine step, and frozen init costs 4x more
class Step:
    """Everything one step decided and did, as changes to the previous state.

    The scheduled entries are `num_decodes` implicit ones (the first running requests
    at the start of the step, in order, one DECODE token each), then `scheduled`.
    `running` and `waiting` are None when the reducer derives them exactly (the writer
    checks that before leaving them out)."""

    step: int  # step index
    time_ns: int = 0  # end of the step, monotonic ns since recording started (timing)
    schedule_ns: int = 0  # time in schedule() (timing)
    update_ns: int = 0  # time in update_from_output() (timing)
    token_budget: int = 0  # the step's token budget
    arrivals: tuple[Arrival, ...] = ()  # requests added before this step's schedule()
    num_decodes: int = 0  # leading implicit DECODE entries
    scheduled: tuple[Scheduled, ...] = ()  # the explicit scheduled entries, in order
    admissions: tuple[Admission, ...] = ()  # in order
    preemptions: tuple[Preemption, ...] = ()  # in the order they happened
    shortfalls: tuple[Shortfall, ...] = ()  # requests cut short, with reasons
    running_stop: QueueStop | None = None  # why the running pass stopped early
    waiting_stop: QueueStop | None = None  # why the waiting pass stopped early
    finishes: tuple[Finish, ...] = ()  # in order
    sample_counts: tuple[int, ...] | None = None  # per scheduled entry; None: one each
    sampled_tokens: tuple[int, ...] | None = None  # all sampled ids, entry order; None: redacted
    other_samples: tuple[Sample, ...] = ()  # samples without a scheduled entry
    spec_accepted: tuple[SpecAccepted, ...] = ()  # drafts accepted per speculative request
    kv_events: KVEvents = NO_KV_EVENTS  # every block movement, in order
    free_blocks_after_schedule: int = 0  # free blocks right after schedule()
    free_blocks: int = 0  # free blocks at the end of the step
    running: tuple[int, ...] | None = None  # running queue at the end; None: derived
    waiting: tuple[int, ...] | None = None  # waiting queue at the end; None: derived
    timings: tuple[Timing, ...] = ()  # runner timings resolved this step

    @property
    def num_scheduled_tokens(self) -> int:
        """The budget used: every scheduled entry's tokens, the leading decodes' included."""
        return self.num_decodes + sum(e.num_tokens for e in self.scheduled)


# -- snapshot -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSnap:
    """One unfinished request in a snapshot."""

    ref: int  # request
    request_id: str  # the engine's request id
    status: int  # WAITING, RUNNING or PREEMPTED
    num_prompt_tokens: int  # prompt length
    num_output_tokens: int  # tokens sampled so far
    num_computed_tokens: int  # tokens in the KV cache
    block_ids: tuple[int, ...]  # its block table
    num_preemptions: int  # times preempted
    priority: int  # lower runs first under the priority policy
    arrival_time: float  # the policies' tie-break order
    num_cached_tokens: int  # prefix-hit tokens at first admission (-1: not admitted yet)
    max_tokens: int  # output tokens, at most
    arrival_step: int = -1  # step it arrived in (-1: before the recording)
    first_scheduled_step: int = -1  # step it was first admitted in (-1: not yet or unknown)
    first_token_step: int = -1  # step of its first sampled token (-1: not yet or unknown)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The full state after step `step`: a reader can start here."""

    step: int  # the last step applied (first_step - 1: before any)
    next_ref: int  # the ref the next arrival gets
    requests: tuple[RequestSnap, ...]  # unfinished requests, by ref
    running: tuple[int, ...]  # running queue, in order
    waiting: tuple[int, ...]  # waiting queue, in admission order
    free_queue: tuple[int, ...]  # free block ids, head (reused first) to tail
    cached_block_ids: tuple[int, ...]  # blocks holding a hash, ascending
    cached_hashes: tuple[bytes, ...]  # their hashes, in the same order


# -- footer ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footer:
    """Written at clean close: where every step and snapshot is, and totals."""

    first_step: int  # step of step_offsets[0]
    step_offsets: tuple[int, ...]  # byte offset of every step record; () if too many
    snapshot_steps: tuple[int, ...]  # the step of each snapshot
    snapshot_offsets: tuple[int, ...]  # byte offset of each snapshot record
    num_steps: int  # step records written
    num_arrivals: int  # requests that arrived
    num_finishes: int  # requests that finished
    num_preemptions: int  # preemptions
    end_time_ns: int  # monotonic ns since recording started, at close (timing)


@dataclass(frozen=True, slots=True)
class End:
    """The last record: where the footer starts. Fixed size, so it is found from the end."""

    footer_offset: int  # byte offset of the footer record


# -- client (schedtop serve) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Client:
    """One HTTP request as the server in front of the engine saw it, written when its
    response ended (between two steps). Timings are the server's, around the client:
    from the moment the HTTP request arrived."""

    after_step: int  # the last step recorded before it (first_step - 1: none yet)
    time_ns: int  # when it was written, monotonic ns since recording started (timing)
    request_id: str  # the engine's request id; "" when it never reached the engine
    endpoint: str  # the route, e.g. "/v1/completions"
    status: int  # HTTP status code of the response
    finish_reason: str = ""  # "stop", "length", "abort" (client left), "error"; "" refused
    stream: bool = False  # server-sent events rather than one JSON body
    prompt_tokens: int = 0  # prompt length
    completion_tokens: int = 0  # output tokens generated
    queue_ns: int | None = None  # arrived -> first scheduled (None: never scheduled)
    ttft_ns: int | None = None  # arrived -> first token sent (None: none sent)
    e2e_ns: int = 0  # arrived -> response ended
    itl_ns: tuple[int, ...] = ()  # gaps between consecutive token chunks sent
    message: str = ""  # for a 4xx/5xx: what was wrong


Record = Header | Step | Snapshot | Footer | End | Client
