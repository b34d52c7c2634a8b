"""The vocabulary of a step, defined once: the engine fills these records in, the recorder
encodes them, the trace reader decodes them, and replays and the TUI read them.

Requests are named by their *ref*: the ordinal the engine gives each request it is handed
(0, 1, 2, ... per run). Request ids may be reused once a request has finished; refs never
are, and they are small integers. Enum-valued fields hold plain ints where they come from
a trace (the enums below name them), so that a reader can carry a value it does not know.

Pure Python, no torch: the trace reader imports this module without the model stack.
`docs/trace-format.md` says how each record is encoded.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, getitem
from typing import Any, Protocol, overload

from engine.limits import MAX_LOGIT_BIAS, check_range


class Status(enum.IntEnum):
    """A request's lifecycle state; every value above PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # aborted by the caller, from waiting or running
    FINISHED_ERROR = 6  # can never run (e.g. more blocks than the pool has)


class Kind(enum.IntEnum):
    """What a scheduled request's tokens are."""

    PREFILL = 0  # the rest of the prompt (or of a recompute), ending with a sample
    CHUNK = 1  # part of a prefill; no sample this step
    DECODE = 2  # exactly one token after the last sampled one
    SPEC = 3  # one token plus draft tokens to verify


class Reason(enum.IntEnum):
    """Why a request was not scheduled, or got fewer tokens than it wanted."""

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
    RETRACTED = 11  # (1.5) SGLang: the decode batch's next tokens did not fit the pool


class KVKind(enum.IntEnum):
    """A KV event's kind."""

    ALLOCATED = 0  # fresh blocks from the free-queue head appended to a request's table
    FREED = 1  # a request's whole table released, tail-first; shared blocks just lose a ref
    PREFIX_HIT = 2  # cached blocks appended to a request's table (ref_cnt += 1)
    CACHED = 3  # full blocks of a request got their hash and became findable
    EVICTED = 4  # free blocks handed out again lost their hash


# One label per enum value, for every screen and command line (the TUI, diff, stats,
# export); the API's finish_reason words are FINISH_REASONS, below.
STATUS_LABELS: dict[int, str] = {
    Status.WAITING: "waiting",
    Status.RUNNING: "running",
    Status.PREEMPTED: "preempted",
    Status.FINISHED_STOPPED: "stopped",
    Status.FINISHED_LENGTH_CAPPED: "length",
    Status.FINISHED_ABORTED: "aborted",
    Status.FINISHED_ERROR: "error",
}
# A finished status as an API's finish_reason (OpenAI's and vLLM's spelling): what
# `run` and `serve` answer and what a CLIENT record's finish_reason holds.
FINISH_REASONS: dict[int, str] = {
    Status.FINISHED_STOPPED: "stop",
    Status.FINISHED_LENGTH_CAPPED: "length",
    Status.FINISHED_ABORTED: "abort",
    Status.FINISHED_ERROR: "error",
}
KIND_LABELS: dict[int, str] = {
    Kind.PREFILL: "prefill",
    Kind.CHUNK: "chunk",
    Kind.DECODE: "decode",
    Kind.SPEC: "spec",
}
REASON_LABELS: dict[int, str] = {
    Reason.TOKEN_BUDGET: "token budget",
    Reason.LONG_PREFILL_THRESHOLD: "long-prefill cap",
    Reason.MAX_NUM_SEQS: "max_num_seqs",
    Reason.KV_BLOCKS: "no free KV blocks",
    Reason.WATERMARK: "KV watermark",
    Reason.FULL_PROMPT: "whole prompt won't fit",
    Reason.PREEMPTION: "a preemption this step",
    Reason.HEAD_OF_LINE: "behind the queue head",
    Reason.MAX_MODEL_LEN: "max_model_len",
    Reason.PREEMPTED: "preempted",
    Reason.NO_CHUNKING: "needs chunking (off)",
    Reason.RETRACTED: "retracted (decode out of KV)",
}
# The config knobs behind each reason (vLLM's names, as `--set` takes them): what to turn
# when a request waits for that reason. None for a reason that is a symptom of another
# (behind the queue head: the head's reason; a preemption: the pool's).
REASON_KNOBS: dict[int, tuple[str, ...]] = {
    Reason.TOKEN_BUDGET: ("max_num_batched_tokens",),
    Reason.LONG_PREFILL_THRESHOLD: ("long_prefill_token_threshold",),
    Reason.MAX_NUM_SEQS: ("max_num_seqs",),
    Reason.KV_BLOCKS: ("num_blocks", "watermark", "kv_cache_memory"),
    Reason.WATERMARK: ("watermark",),
    Reason.FULL_PROMPT: ("scheduler_reserve_full_isl",),
    Reason.PREEMPTION: (),
    Reason.HEAD_OF_LINE: (),
    Reason.MAX_MODEL_LEN: ("max_model_len",),
    Reason.PREEMPTED: ("num_blocks", "kv_cache_memory"),
    Reason.NO_CHUNKING: ("enable_chunked_prefill",),
    Reason.RETRACTED: ("num_blocks", "kv_cache_memory"),
}
# The pseudo-reason of a request a step left unscheduled with no reason in its record (no
# pass reached it), in the wait accounting (replays.queueing, tui.waits); never in a trace.
NOT_REACHED = -1
WAIT_LABELS: dict[int, str] = {**REASON_LABELS, NOT_REACHED: "not reached"}


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` safe to print on a terminal: control characters (escape sequences that clear
    the screen or retitle the window, C1 codes, bidi overrides) shown as `\\xNN` /
    `\\uNNNN`; newlines and tabs kept. Everything printed from a trace or a workload (ids,
    host, model names, messages) goes through it."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def label(table: dict[int, str], value: int) -> str:
    """A value's label; one this version does not know (a newer trace's) as its number."""
    return table.get(value, f"#{value}")


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for none. The
    one percentile of every summary: the engine's run summaries and a trace's stats."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples and when it stops."""

    max_tokens: int = 16  # output tokens, at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # most likely tokens kept (0 = off)
    seed: int | None = None  # per-request generator: same tokens in any batch
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request (kept in the output)
    ignore_eos: bool = False  # keep going past the model's EOS token
    # vLLM's logits processing (engine/model/sampler.py has the definitions); the defaults
    # change nothing, and the sampler's fast path runs while every request has them.
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # divides (shrinks) logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # return each sampled token's logprob and this many top ones

    def __post_init__(self) -> None:
        # engine.limits has the ranges: NaN, 1e23 or a negative id fail here, not mid-run
        for name in ("max_tokens", "temperature", "top_p", "top_k", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p"):  # fmt: skip
            check_range(name, getattr(self, name))
        if self.top_p == 0:
            raise ValueError("top_p=0.0: must be in (0, 1]")
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty=0.0: must be > 0")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries")
        for t, b in self.logit_bias:
            check_range("token_id", t, "logit_bias")
            check_range("logit_bias", b)
        if self.logprobs is not None:
            check_range("logprobs", self.logprobs)
        if self.seed is not None:
            check_range("seed", self.seed)
        for t in self.stop_token_ids:
            check_range("token_id", t, "stop_token_ids")

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler must change this request's logits before sampling: a
        penalty, a bias or min_p (the default path skips all of that)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_p
            or self.logit_bias
        )


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request added before the step's schedule(); it gets the next ref."""

    ref: int  # the request's ref: the number of requests the engine was handed before it
    request_id: str  # the engine's request id
    num_prompt_tokens: int  # prompt length
    priority: int  # lower runs first under the priority policy
    arrival_time: float  # the policies' tie-break order
    eos_token_id: int | None  # the model's EOS for this request (None: ignored)
    sampling: SamplingParams  # max_tokens, stop ids, ...
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt (a trace: None when redacted)
    prompt_block_hashes: tuple[bytes, ...] | None = None  # full blocks' (a trace: if redacted)
    tenant: str | None = None  # whose it is: a workload's `tenant`, a client's `user` (--group-by)


@dataclass(slots=True)  # not frozen: the engine builds one per request per step (4x cheaper)
class Scheduled:
    """One request's share of the step, in scheduling order (in a trace: one beyond the
    step's leading decodes)."""

    ref: int  # request
    num_tokens: int  # tokens computed this step
    kind: int  # a Kind
    num_computed_before: int  # tokens in the KV cache before this step
    num_spec_tokens: int = 0  # draft tokens among num_tokens


class HasRef(Protocol):
    """What Entries reads of the request behind an implicit decode entry: its ref, which
    never changes once the scheduler has given it."""

    @property
    def ref(self) -> int: ...


_REF, _KIND = attrgetter("ref"), attrgetter("kind")
_DECODE = Kind.DECODE


class Entries(Sequence[Scheduled]):
    """A step's scheduled entries as the engine reports them: a tuple of Scheduled to every
    reader, without one object per decode (most entries of most steps).

    Building a Scheduled for every running request every step was the larger part of the
    scheduler's per-request cost, and kept the garbage collector busy (the records lived
    until the next step and so reached the old generation). Here entry i is `explicit[i]`
    where the step built one (a prefill, a chunk, a speculative entry: anything but a
    DECODE, which is always one token), else a DECODE of `owners[i]` with `before[i]`
    tokens computed before the step. The Scheduled objects are built on first full read
    and kept; the hot readers (the compactor, the metrics) use `refs`, `num_explicit`,
    `num_leading_decodes` and `num_tokens` instead. Never changed once built: the
    scheduler hands its own lists over.
    """

    __slots__ = ("_owners", "_before", "_explicit", "_tuple")

    def __init__(
        self, owners: Sequence[HasRef], before: Sequence[int], explicit: dict[int, Scheduled]
    ) -> None:
        self._owners = owners  # per entry: the request (only its ref is read)
        self._before = before  # per entry: tokens computed before the step
        self._explicit = explicit  # entry index -> its record, for every entry not a decode
        self._tuple: tuple[Scheduled, ...] | None = None

    def as_tuple(self) -> tuple[Scheduled, ...]:
        """Every entry as a Scheduled, in order (built once)."""
        t = self._tuple
        if t is None:
            get = self._explicit.get
            t = self._tuple = tuple(
                get(i) or Scheduled(owner.ref, 1, _DECODE, before, 0)
                for i, (owner, before) in enumerate(zip(self._owners, self._before))
            )
        return t

    @property
    def refs(self) -> tuple[int, ...]:
        """Each entry's request, in order, with no Scheduled built."""
        return tuple(map(_REF, self._owners))

    @property
    def num_explicit(self) -> int:
        """Entries that are not a DECODE (0: every entry is one)."""
        return len(self._explicit)

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled over all entries."""
        explicit = self._explicit
        return len(self._owners) - len(explicit) + sum(e.num_tokens for e in explicit.values())

    def __len__(self) -> int:
        return len(self._owners)

    @overload
    def __getitem__(self, index: int) -> Scheduled: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Scheduled, ...]: ...

    def __getitem__(self, index: int | slice) -> Scheduled | tuple[Scheduled, ...]:
        if self._tuple is not None:
            return self._tuple[index]
        if isinstance(index, slice):  # a trace's explicit entries: those past the decodes
            return tuple(map(self._entry, range(*index.indices(len(self._owners)))))
        return self._entry(range(len(self._owners))[index])

    def _entry(self, i: int) -> Scheduled:
        explicit = self._explicit.get(i)
        if explicit is not None:
            return explicit
        return Scheduled(self._owners[i].ref, 1, _DECODE, self._before[i], 0)

    @property
    def num_leading_decodes(self) -> int:
        """Entries before the first that is not a DECODE."""
        return min(self._explicit, default=len(self._owners))

    def __iter__(self) -> Iterator[Scheduled]:
        return iter(self.as_tuple())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Entries):
            return self.as_tuple() == other.as_tuple()
        if isinstance(other, tuple):
            return self.as_tuple() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like its Scheduled: compared, not hashed

    def __repr__(self) -> str:
        return repr(self.as_tuple())

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the plain tuple: the requests it points to stay in this process.
        return tuple, (self.as_tuple(),)


def entry_refs(entries: Sequence[Scheduled]) -> Sequence[int]:
    """The entries' requests, in order (Entries: without building its records)."""
    if isinstance(entries, Entries):
        return entries.refs
    return tuple(map(_REF, entries))


def entry_tokens(entries: Sequence[Scheduled]) -> int:
    """Tokens scheduled over `entries` (Entries: without building its records)."""
    if isinstance(entries, Entries):
        return entries.num_tokens
    return sum(e.num_tokens for e in entries)


def leading_decodes(entries: Sequence[Scheduled]) -> int:
    """How many entries come before the first that is not a DECODE (always one token)
    (Entries: without building its records)."""
    if isinstance(entries, Entries):
        return entries.num_leading_decodes
    kinds = list(map(_KIND, entries))
    if kinds.count(_DECODE) == len(kinds):  # one C-level pass for the common case
        return len(kinds)
    return next(i for i, kind in enumerate(kinds) if kind != _DECODE)


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """(1.9, a token pool's slot map) Token slots written into a request's row (SGLang's
    req_to_token) from `position` on: an admission's radix-cache prefix, or the radix
    cache's own slots replacing a prefilled prompt's duplicates. In a snapshot, a whole
    row (position 0)."""

    ref: int  # request
    position: int  # the first token position written
    runs: tuple[int, ...]  # the slots, as runs: start, length, start, length, ...


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
    # (1.5) why: KV_BLOCKS (an allocation failed: vLLM, schedtop) or RETRACTED (SGLang's
    # decode batch did not fit the pool; for_request is then the victim itself)
    cause: int = 3


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


# Finish.message of an abort that came between schedule() and the update (vLLM's engine
# core applies aborts there): re-simulation aborts the request at the same point.
MID_STEP_ABORT = "aborted after schedule"


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
class SpecProposed:
    """Draft tokens the drafter proposed for a request this step, to be verified when it
    is next scheduled (the scheduler may cut them to fit the budget)."""

    ref: int  # request
    count: int  # drafts proposed (requests that sampled and are not listed got none)


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

# A block hash as records keep it: the first 8 bytes of the engine's SHA-256 (format 1.3).
# Records only tell blocks apart (which prefix a block holds, which blocks share one); 64
# bits do that (two of a million distinct blocks collide with odds of about 3e-8), at a
# quarter of the bytes. The engine's prefix cache itself keys on the whole hash.
HASH_BYTES = 8
_SHORT = slice(0, HASH_BYTES)


def trace_hashes(hashes: Sequence[bytes]) -> tuple[bytes, ...]:
    """Hashes as records keep them (HASH_BYTES long; shorter ones are left as they are)."""
    cut: Any = getitem  # typeshed's overloads of getitem do not take a slice of bytes
    return tuple(map(cut, hashes, repeat(_SHORT, len(hashes))))


def ns(seconds: float) -> int:
    """Seconds as whole nanoseconds (never negative): how every record holds a duration."""
    return max(0, round(seconds * 1e9))


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
    propose_ns: int = 0  # the drafter's proposals (format 1.1)


@dataclass(slots=True)  # not frozen: one per engine step, and frozen init costs 4x more
class Step:
    """Everything one step decided and did, as changes to the previous state.

    The engine reports each step explicitly: every scheduled entry in `scheduled` (an
    Entries, which reads as the tuple of them; entry_refs and entry_tokens read it without
    building the records), both queues, `num_decodes` 0. A trace keeps it compact: the
    scheduled entries are `num_decodes` implicit ones (the first running requests at the
    start of the step, in order, one DECODE token each, passing over those in
    `decode_skips`), then `scheduled`; `running` and `waiting` are None when the reducer
    derives them exactly (the recorder checks that before leaving them out). Not frozen
    (one per step, and frozen construction costs 4x), but never changed once built."""

    step: int  # step index
    time_ns: int = 0  # end of the step, monotonic ns since recording started (timing)
    schedule_ns: int = 0  # time in schedule() (timing)
    update_ns: int = 0  # time in update_from_output() (timing)
    token_budget: int = 0  # the step's token budget
    arrivals: tuple[Arrival, ...] = ()  # requests added before this step's schedule()
    num_decodes: int = 0  # leading implicit DECODE entries
    # the explicit scheduled entries, in order (from the engine: an Entries, which reads as
    # a tuple; from a trace: a tuple)
    scheduled: Sequence[Scheduled] = ()
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
    spec_proposed: tuple[SpecProposed, ...] = ()  # drafts proposed per request (format 1.1)
    work_ns: int = 0  # the engine's own time in the step, from step() to this record (1.4)
    # (1.5) a token pool (Header.kv_pool "tokens", SGLang): slots a new request could get
    # (free or evictable from the radix cache), and slots the radix cache holds
    free_slots: int = 0
    cached_slots: int = 0
    # (1.7) refs of running requests (as schedule() found them) that the implicit decodes
    # pass over: async scheduling does not schedule a request whose last token is in
    # flight, and without this one such request in the middle of running spelled out
    # every entry after it
    decode_skips: tuple[int, ...] = ()
    # (1.8) slots the radix cache evicted (freed back to the pool) during the step; a
    # count only: the trace tracks no slot, so there are no blocks to name
    evicted_slots: int = 0
    # (1.9, Header.slot_map) the token pool slot by slot, as runs (start, length, ...):
    # the slots the step's scheduled entries were given (one a token, in entry order),
    # slots written into rows, slots freed before those allocations (in the schedule:
    # evictions, retractions) and after them (results: releases, duplicates), and the
    # radix cache's evictable slots at the end of the step
    slot_allocs: tuple[int, ...] = ()
    slot_writes: tuple[SlotWrite, ...] = ()
    slots_freed_first: tuple[int, ...] = ()
    slots_freed: tuple[int, ...] = ()
    evictable_slots: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        """The budget used: every scheduled entry's tokens, the leading decodes' included."""
        return self.num_decodes + entry_tokens(self.scheduled)

    def duration_ns(self, prev_end_ns: int) -> int:
        """The step's work: `work_ns` where recorded (format 1.4), else the wall time since
        `prev_end_ns` (the previous step's end; 0 for the first step of a recording), which
        in older traces includes any idle wait before the step (docs/metrics.md)."""
        if self.work_ns:
            return self.work_ns
        return max(0, self.time_ns - prev_end_ns)

    def idle_ns(self, prev_end_ns: int) -> int:
        """The wait before the step: from `prev_end_ns` to the step's start (0 when the
        record has no `work_ns`: an older trace cannot tell idle from work)."""
        if not self.work_ns:
            return 0
        return max(0, self.time_ns - self.work_ns - prev_end_ns)


# -- snapshot -------------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: the reducer updates it in place, step by step
class RequestState:
    """One unfinished request: in a snapshot record, in the engine's snapshot, and in the
    state the reducer rebuilds from a trace."""

    ref: int  # request
    request_id: str  # the engine's request id
    status: int  # a Status: WAITING, RUNNING or PREEMPTED
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

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def priority_order(self) -> tuple[int, float, str]:
        return (self.priority, self.arrival_time, self.request_id)

    def copy(self) -> RequestState:
        return RequestState(*_REQUEST_FIELDS(self))


_REQUEST_FIELDS = attrgetter(*RequestState.__match_args__)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The full state after step `step`: a reader can start here."""

    step: int  # the last step applied (first_step - 1: before any)
    next_ref: int  # the ref the next arrival gets
    requests: tuple[RequestState, ...]  # unfinished requests, by ref
    running: tuple[int, ...]  # running queue, in order
    waiting: tuple[int, ...]  # waiting queue, in admission order
    free_queue: tuple[int, ...]  # free block ids, head (reused first) to tail
    cached_block_ids: tuple[int, ...]  # blocks holding a hash, ascending
    cached_hashes: tuple[bytes, ...]  # their hashes, in the same order
    # (1.9, Header.slot_map) the token pool: each running request's row, the free slots
    # (runs) and the evictable count
    slot_rows: tuple[SlotWrite, ...] = ()
    free_slot_runs: tuple[int, ...] = ()
    evictable_slots: int = 0


# -- client (schedtop serve) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Client:
    """One HTTP request as the server in front of the engine saw it, written when its
    response ended (between two steps). Timings are the server's, around the client:
    from the moment the HTTP request arrived."""

    # The server fills these in with -1 and 0; the recorder stamps them as it writes.
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
    # n > 1 (parallel sampling): one record per choice, each its own engine request with
    # its own timings; they share this, the HTTP request's id, and are one response
    parent_id: str = ""
