"""Verifying drafts: which of a request's draft tokens the target model keeps.

A request with d drafts has d + 1 rows of logits: row j predicts the token after the
j-th query token (the last known one, then each draft). Greedy requests keep the longest
prefix of drafts that equals the row-wise argmax, plus the argmax after it (the bonus
token). Sampled requests use rejection sampling, which keeps the output distribution
exactly the target model's: an n-gram draft is one token with probability 1, so draft x
is accepted with probability p(x), and on rejection the token is drawn from p with x
removed and renormalised (the residual max(p - q, 0) for a one-hot q). When every draft
is accepted, the bonus token is drawn from the last row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.sampler import _TINY, Sampler, SamplingBatch, step_seed
from engine.request import SamplingParams


@dataclass
class Verification:
    """The rows of one step's logits that belong to each sampling request."""

    drafts: list[list[int]]  # per sampling request: its drafts (empty: a plain sample)
    params: list[SamplingParams]  # per sampling request
    output_positions: list[int]  # per sampling request: output index of its first new token

    @property
    def num_rows(self) -> list[int]:
        return [len(d) + 1 for d in self.drafts]


def verify(logits: torch.Tensor, v: Verification, sampler: Sampler) -> list[list[int]]:
    """logits [sum(d + 1), V] -> per request, the accepted drafts and one more token."""
    counts = v.num_rows
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
    greedy = logits.argmax(dim=-1).tolist()
    out: list[list[int]] = []
    sampled_reqs = [i for i, p in enumerate(v.params) if p.temperature > 0]
    for i, (start, drafts) in enumerate(zip(starts, v.drafts)):
        if v.params[i].temperature > 0:
            out.append([])  # filled below
            continue
        rows = greedy[start : start + len(drafts) + 1]
        a = 0
        while a < len(drafts) and drafts[a] == rows[a]:
            a += 1
        out.append(rows[: a + 1])
    if sampled_reqs:
        _rejection_sample(logits, v, sampler, sampled_reqs, starts, out)
    return out


def _rejection_sample(
    logits: torch.Tensor,
    v: Verification,
    sampler: Sampler,
    reqs: list[int],
    starts: list[int],
    out: list[list[int]],
) -> None:
    rows = [starts[i] + j for i in reqs for j in range(len(v.drafts[i]) + 1)]
    params = [v.params[i] for i in reqs for _ in range(len(v.drafts[i]) + 1)]
    positions = [v.output_positions[i] + j for i in reqs for j in range(len(v.drafts[i]) + 1)]
    # The runner applied bias and penalties to the logits already (requests with them
    # verify no drafts, so their one row is exact); min-p is part of the probabilities.
    batch = SamplingBatch.from_params(params, positions, logits.device, with_processing=False)
    probs = Sampler.probabilities(logits[rows], batch)  # [R, V]
    uniform, noise = _draws(probs, batch, sampler)
    # p(x) of every draft at its row, in one gather (one device sync, not one per draft).
    draft_rows = [r for r, pos in enumerate(_offsets(v, reqs)) if pos >= 0]
    draft_ids = [max(x, 0) for i in reqs for x in v.drafts[i]]
    p_draft = iter(probs[draft_rows, draft_ids].tolist() if draft_ids else ())
    at = 0
    for i in reqs:
        drafts = v.drafts[i]
        p = probs[at : at + len(drafts) + 1]
        gathered = [next(p_draft) for _ in drafts]
        p_x = [px if x >= 0 else 0.0 for px, x in zip(gathered, drafts)]  # placeholder: 0
        tokens: list[int] = []
        for j, x in enumerate(drafts):
            if uniform[at + j] < p_x[j]:
                tokens.append(x)
                continue
            residual = p[j].clone()
            if x >= 0:
                residual[x] = 0.0  # a one-hot draft: max(p - q, 0) is p without x
            tokens.append(int((residual / noise[at + j]).argmax()))
            break
        else:
            tokens.append(int((p[-1] / noise[at + len(drafts)]).argmax()))
        out[i] = tokens
        at += len(drafts) + 1


def _offsets(v: Verification, reqs: list[int]) -> list[int]:
    """Per row of the sampled requests: the index of the draft it tests (-1: the bonus
    row, which tests none)."""
    return [j if j < len(v.drafts[i]) else -1 for i in reqs for j in range(len(v.drafts[i]) + 1)]


def _draws(
    probs: torch.Tensor, batch: SamplingBatch, sampler: Sampler
) -> tuple[list[float], torch.Tensor]:
    """Per row: a uniform for the accept test and Exp(1) noise for the exponential race
    (argmax p / E picks i with probability p_i). A seeded request draws both from its
    (seed, output position) generator, so its tokens do not depend on the batch."""
    n = probs.shape[0]
    uniform = torch.empty(n, dtype=torch.float32, device=probs.device)
    noise = torch.empty_like(probs)
    if any(s is None for s in batch.seeds):
        uniform.uniform_(generator=sampler.generator)
        noise.exponential_(generator=sampler.generator)
    for r, seed in enumerate(batch.seeds):
        if seed is not None:
            gen = torch.Generator(device=probs.device)
            gen.manual_seed(step_seed(seed, batch.positions[r]))
            noise[r].exponential_(generator=gen)
            uniform[r : r + 1].uniform_(generator=gen)
    return uniform.tolist(), noise.clamp_(min=_TINY)
