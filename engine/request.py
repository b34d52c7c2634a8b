"""Requests, their lifecycle states and sampling parameters."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every state after PREEMPTED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # aborted by the caller, from waiting or running
    FINISHED_ERROR = 6  # can never run (e.g. more blocks than the pool has)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


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

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")


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
    status: RequestStatus = RequestStatus.WAITING
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
        return self.status > RequestStatus.PREEMPTED

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_hasher is not None:
            self.block_hasher(self)

    def sort_key(self) -> tuple[int, float, str]:
        """Priority-queue order: (priority, arrival_time, request_id), smallest first."""
        return (self.priority, self.arrival_time, self.request_id)

    def __lt__(self, other: Request) -> bool:
        return self.sort_key() < other.sort_key()

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
