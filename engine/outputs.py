"""The two boundaries of a step: what the scheduler tells the runner, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.records import SamplingParams, Timing


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One sampled token's log-probability, from the model's raw logits (vLLM's default
    logprobs mode: before penalties, bias and temperature), and the most likely tokens."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    rank: int  # 1 + the number of tokens more likely than it
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the k most likely


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: new, or resumed after preemption (recompute)."""

    req_id: str  # request id
    token_ids: list[int]  # every known token: the prompt, plus earlier outputs when resumed
    num_prompt_tokens: int  # the original prompt's length (outputs start after it)
    sampling_params: SamplingParams  # how to sample its next tokens
    block_ids: list[int]  # its whole block table
    num_computed_tokens: int  # tokens already in the KV cache (prefix hits)


@dataclass(slots=True)
class CachedRequestData:
    """Running requests the runner already holds, in scheduling order (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)  # request ids
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)  # computed before this step


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions: which requests run and how many tokens each computes."""

    step: int  # step index, from 0
    scheduled_new_reqs: list[NewRequestData]  # new and resumed requests
    scheduled_cached_reqs: CachedRequestData  # running requests that continue
    num_scheduled_tokens: dict[str, int]  # tokens per request, in scheduling order
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    scheduled_spec_decode_tokens: dict[str, list[int]]  # draft tokens to verify, per request
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str]  # preempted this step: the runner drops their state

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the runner computed for one SchedulerOutput."""

    req_ids: list[str]  # the scheduled requests, in scheduling order
    sampled_token_ids: list[list[int]]  # per request: [] mid-prefill; accepted drafts + 1
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for next step
    timings: list[Timing] = field(default_factory=list)  # measurements resolved now
    # per request that asked for logprobs: one entry per sampled token (in sampled order)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
