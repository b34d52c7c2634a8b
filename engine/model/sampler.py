"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, penalties, logit
bias, per-request seeds, and the sampled tokens' log-probabilities.

Logits processing follows vLLM's definitions and order: logit_bias is added, then the
penalties (repetition: a logit of a token in the prompt or the output is divided by the
penalty when positive, multiplied when negative; frequency: minus the penalty times the
token's count in the output; presence: minus the penalty once it is in the output), and
greedy requests take the argmax of that. Sampled ones then divide by the temperature, drop
tokens under min_p times the most likely one's probability, then the top-k and top-p tails.
Logprobs are of the raw logits (vLLM's default logprobs mode). A batch where no request
asks for any of this takes the path it took before, with no extra tensor work.

Sampling uses the exponential race: token = argmax(p / E) with E ~ Exp(1) drawn per vocab
entry, which picks token i with probability p_i. Excluded tokens have p = 0 and can never
win. A seeded request draws its E from a generator seeded by (seed, output position), so
its tokens do not depend on which other requests share the batch, nor on preemptions.
Stop tokens, EOS and max_tokens are the scheduler's business (update_from_output)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import TokenLogprobs
from engine.request import SamplingParams

# For row i of a batch: (its prompt's token ids, its output's token ids so far).
History = Callable[[int], tuple[np.ndarray, np.ndarray]]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 63 bits
_TINY = torch.finfo(torch.float32).tiny


def step_seed(seed: int, position: int) -> int:
    """The generator seed for a seeded request's `position`-th output token."""
    return (seed * _MIX + position) % (1 << 63)


@dataclass
class Processing:
    """The logits processing of the rows that ask for it, as flat (row, token) entries:
    a bias entry per biased token, and a penalty entry per distinct token of a penalized
    row's prompt and output (the only logits a penalty changes), so that the work is
    proportional to those tokens, not to rows times the vocabulary."""

    bias_rows: torch.Tensor | None  # [B] row of each bias entry
    bias_ids: torch.Tensor | None  # [B] its token
    bias_values: torch.Tensor | None  # [B] what is added to that token's logit
    pen_rows: torch.Tensor | None  # [E] row of each penalty entry
    pen_ids: torch.Tensor | None  # [E] a token in that row's prompt or output
    repetition: torch.Tensor | None  # [E] the row's repetition penalty
    frequency: torch.Tensor | None  # [E] the row's frequency penalty times the output count
    presence: torch.Tensor | None  # [E] the row's presence penalty if in the output, else 0


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
    min_p: torch.Tensor | None = None  # [N] fp32, when some request uses min-p
    processing: Processing | None = None  # when some request has a penalty or a bias
    logprobs: list[int | None] | None = None  # per request: top logprobs wanted (None: none)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        device: torch.device,
        history: History | None = None,
        vocab_size: int = 0,
        with_processing: bool = True,
    ) -> SamplingBatch:
        """`history` and `vocab_size` are needed only when a request has a penalty;
        `with_processing=False`: the caller has applied the bias and penalties already
        (the verification of drafts), only min-p is left to the probabilities."""
        temps = [p.temperature for p in params]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        batch = cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            seeds=[p.seed for p in params],
            positions=list(positions),
            all_greedy=all(t == 0 for t in temps),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1 for p in top_p),
        )
        if any(p.logprobs is not None for p in params):
            batch.logprobs = [p.logprobs for p in params]
        if any(p.processes_logits for p in params):
            if any(p.min_p for p in params):
                mins = [p.min_p for p in params]
                batch.min_p = torch.tensor(mins, dtype=torch.float32, device=device)
            if with_processing:
                batch.processing = _processing(params, device, history, vocab_size)
        return batch


def _processing(
    params: Sequence[SamplingParams],
    device: torch.device,
    history: History | None,
    vocab_size: int,
) -> Processing | None:
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for t, b in p.logit_bias:
            rows.append(i)
            ids.append(t)
            values.append(b)
    pen = [
        i
        for i, p in enumerate(params)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
    ]
    if not rows and not pen:
        return None  # min_p only: it works on probabilities, not here
    proc = Processing(None, None, None, None, None, None, None, None)
    if rows:
        proc.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        proc.bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        proc.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
    if pen:
        if history is None or vocab_size <= 0:
            raise ValueError("penalties need each request's tokens and the vocabulary size")
        e_rows, e_ids, e_rep, e_freq, e_pres = [], [], [], [], []
        for i in pen:
            prompt, output = history(i)
            seen = np.unique(np.concatenate((prompt, output)).astype(np.int64))
            seen = seen[(seen >= 0) & (seen < vocab_size)]
            counts = np.zeros(len(seen), dtype=np.float32)
            if len(output) and len(seen):
                out_ids, out_counts = np.unique(output, return_counts=True)
                at = np.minimum(np.searchsorted(seen, out_ids), len(seen) - 1)
                ok = seen[at] == out_ids
                counts[at[ok]] = out_counts[ok]
            p = params[i]
            e_rows.append(np.full(len(seen), i, dtype=np.int64))
            e_ids.append(seen)
            e_rep.append(np.full(len(seen), p.repetition_penalty, dtype=np.float32))
            e_freq.append(np.float32(p.frequency_penalty) * counts)
            e_pres.append(np.float32(p.presence_penalty) * (counts > 0).astype(np.float32))

        def flat(parts: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(device=device, dtype=dtype)

        proc.pen_rows = flat(e_rows, torch.int64)
        proc.pen_ids = flat(e_ids, torch.int64)
        proc.repetition = flat(e_rep, torch.float32)
        proc.frequency = flat(e_freq, torch.float32)
        proc.presence = flat(e_pres, torch.float32)
    return proc


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after logit_bias and the penalties (a new tensor: the raw logits stay
    as they are, for logprobs). The identity when no request asks for either."""
    proc = batch.processing
    if proc is None:
        return logits
    x = logits.clone()
    if proc.bias_rows is not None:
        assert proc.bias_ids is not None and proc.bias_values is not None
        x.index_put_((proc.bias_rows, proc.bias_ids), proc.bias_values, accumulate=True)
    if proc.pen_rows is not None:
        assert proc.pen_ids is not None and proc.repetition is not None
        assert proc.frequency is not None and proc.presence is not None
        index = (proc.pen_rows, proc.pen_ids)  # distinct pairs: the writes do not collide
        v = x[index]
        rep = proc.repetition
        v = torch.where(v > 0, v / rep, v * rep) - proc.frequency - proc.presence
        x.index_put_(index, v)
    return x


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], wanted: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row: the logprob and rank of its token under log_softmax(logits), and the
    `wanted[i]` most likely tokens (None where a row wants none). One device sync."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(wanted)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    chosen = torch.tensor([tokens[i] for i in rows], dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    at = lp.gather(1, chosen[:, None])
    rank = (lp > at).sum(dim=-1) + 1
    k = max(int(wanted[i] or 0) for i in rows)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], chosen[:, None][:, :0])
    at_l, rank_l = at[:, 0].tolist(), rank.tolist()
    top_lp_l, top_ids_l = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = int(wanted[i] or 0)
        top = tuple(zip(top_ids_l[j][:n], top_lp_l[j][:n]))
        out[i] = TokenLogprobs(int(tokens[i]), at_l[j], int(rank_l[j]), top)
    return out


class Sampler:
    """Samples one token per row of logits."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [N, V] fp32 -> tokens [N] int64."""
        logits = process_logits(logits, batch)
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
        if batch.min_p is not None:
            # vLLM's min-p: after the temperature, before top-k and top-p
            probs = torch.softmax(x, dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * batch.min_p[:, None]
            x = x.masked_fill(probs < floor, float("-inf"))
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
