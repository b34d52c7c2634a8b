"""Turn logits into tokens: greedy, temperature, top-k, top-p, and per-request seeds.

Sampling uses the exponential race: token = argmax(p / E) with E ~ Exp(1) drawn per vocab
entry, which picks token i with probability p_i. Excluded tokens have p = 0 and can never
win. A seeded request draws its E from a generator seeded by (seed, output position), so
its tokens do not depend on which other requests share the batch, nor on preemptions.
Stop tokens, EOS and max_tokens are the scheduler's business (update_from_output)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 63 bits
_TINY = torch.finfo(torch.float32).tiny


def step_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's `position`-th output token."""
    return (seed * _MIX + position) % (1 << 63)


@dataclass
class SamplingBatch:
    """Sampling parameters of the requests that sample this step, as tensors."""

    temperature: torch.Tensor  # [N] fp32; 0 = greedy
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] fp32; 1 = off
    seeds: list[int | None]  # per request; None = the runner's generator
    positions: list[int]  # per request: index of the token being sampled in its output
    all_greedy: bool  # every request is greedy: argmax only
    any_top_k: bool  # some request uses top-k
    any_top_p: bool  # some request uses top-p

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device
    ) -> SamplingBatch:
        temps = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            seeds=[p.seed for p in params],
            positions=list(positions),
            all_greedy=all(t == 0 for t in temps),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1 for p in top_p),
        )


class Sampler:
    """Samples one token per row of logits."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [N, V] fp32 -> tokens [N] int64."""
        greedy = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy
        probs = self.probabilities(logits, batch)
        noise = self._exponential(probs, batch)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.temperature == 0, greedy, sampled)

    @staticmethod
    def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Softmax of logits / temperature with the top-k and top-p tails set to 0."""
        temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
        x = logits / temp[:, None]
        if batch.any_top_k or batch.any_top_p:
            x = _filter_top_k_top_p(x, batch)
        return torch.softmax(x, dim=-1)

    def _exponential(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.empty_like(probs)
        if any(s is None for s in batch.seeds):
            noise.exponential_(generator=self.generator)
        for i, seed in enumerate(batch.seeds):
            if seed is not None:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(step_seed(seed, batch.positions[i]))
                noise[i].exponential_(generator=gen)
        return noise.clamp_(min=_TINY)  # E = 0 would make 0 / 0 for an excluded token


def _filter_top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf. The most likely
    token always survives."""
    vocab = x.shape[-1]
    values, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    drop = torch.zeros_like(values, dtype=torch.bool)
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k, vocab)
        drop |= rank >= k[:, None]
    if batch.any_top_p:
        probs = torch.softmax(values.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop |= before >= batch.top_p[:, None]
    drop[:, 0] = False
    return x.scatter(-1, order, values.masked_fill(drop, float("-inf")))
