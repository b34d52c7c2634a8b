"""Requests: the scheduling object, with its lifecycle state and sampling parameters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.outputs import TokenLogprobs
from engine.records import FINISH_REASONS, SamplingParams, Status

__all__ = ["Request", "SamplingParams", "Status"]


BlockHasher = Callable[["Request"], None]


@dataclass(eq=False, slots=True)
class Request:
    """One request: the scheduling object. Tokens are the resource it consumes.

    Invariant: `num_computed_tokens <= num_tokens_with_spec`; tokens in
    `[num_computed_tokens, num_tokens_with_spec)` are what it still wants computed.
    """

    request_id: str  # unique id
    prompt_token_ids: list[int]  # the prompt as given
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # orders FCFS ties and PRIORITY ties
    priority: int = 0  # lower runs first under the priority policy
    eos_token_id: int | None = None  # the model's EOS, unless sampling ignores it
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # sampled so far
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or scheduled to be)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify next step
    num_preemptions: int = 0  # times preempted (recompute)
    num_cached_tokens: int = -1  # prefix-hit tokens at first admission; -1 = not yet admitted
    block_hashes: list[bytes] = field(default_factory=list)  # hash of each full block, chained
    block_hasher: BlockHasher | None = None  # extends block_hashes as tokens become known
    finish_message: str = ""  # why it ended with FINISHED_ERROR
    stop_reason: int | None = None  # the stop token that ended it, if any
    # Async scheduling (vLLM's AsyncScheduler): a step's samples arrive after the next
    # step is scheduled, so the scheduler counts on them before they exist.
    num_output_placeholders: int = 0  # samples scheduled for but not yet received
    num_in_flight_tokens: int = 0  # scheduled tokens whose step has not been updated yet
    num_stale_output_tokens: int = 0  # in-flight tokens from before its last preemption
    ref: int = -1  # its ordinal in the run, given by the scheduler (-1: not added yet)
    arrival_step: int = -1  # the step whose schedule() first saw it
    first_scheduled_step: int = -1  # the step it was first admitted in (-1: not yet)
    first_token_step: int = -1  # the step of its first sampled token (-1: none yet)
    prefill_chunk: bool = False  # its last scheduled step stopped short of its known tokens
    tenant: str | None = None  # whose it is (recorded with its arrival; --group-by tenant)
    # Fast-path thresholds, so that a steady decode step skips the calls that would do
    # nothing for this request. Each is conservative: its default makes the call every
    # time. Not init fields: a copy (dataclasses.replace) starts from the defaults.
    # len(all_token_ids) from which block_hasher has a block to hash (BlockHasher keeps it)
    hash_due: int = field(default=0, init=False, repr=False)
    # len(all_token_ids) from which a length cap may end it (the scheduler keeps it)
    stop_len: int = field(default=0, init=False, repr=False)
    # while num_computed_tokens + new tokens <= kv_quiet, the KV manager's allocate_running
    # would do nothing (the manager keeps it)
    kv_quiet: int = field(default=-1, init=False, repr=False)
    # block_hashes cut to the records' HASH_BYTES, as CACHED events carry them: cut once
    # per block when hashed (BlockHasher keeps it), not each time a step caches the block.
    # A hasher that keeps only block_hashes leaves it short; the KV manager cuts the rest.
    short_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)
    # per output token, when its sampling asks for logprobs (None otherwise: no list kept)
    logprobs: list[TokenLogprobs] | None = None
    all_token_ids: list[int] = field(init=False)  # prompt + outputs
    num_prompt_tokens: int = field(init=False)  # len(prompt_token_ids)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.block_hasher is not None:
            self.block_hasher(self)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status > Status.PREEMPTED

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_hasher is not None and len(self.all_token_ids) >= self.hash_due:
            self.block_hasher(self)

    def sort_key(self) -> tuple[int, float, str]:
        """Priority-queue order: (priority, arrival_time, request_id), smallest first."""
        return (self.priority, self.arrival_time, self.request_id)

    def __lt__(self, other: Request) -> bool:
        return self.sort_key() < other.sort_key()

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
