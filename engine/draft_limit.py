"""How many of the n-gram drafter's proposals are worth verifying, per request.

A draft is not free: verifying it adds a row to every matrix product of the step, and on a
CPU, where a step's cost grows with its rows, a batch of 4 requests pays about a twentieth of
a decode step per draft row. Prompt lookup with a short `prompt_lookup_min` finds some
match almost every step, also in text that does not repeat itself, where nearly every
draft is rejected and all that work is lost.

So each request carries an estimate `alpha` of the chance that its next draft is accepted
(given the ones before it were), and sends the longest prefix of its proposal whose
drafts all stand at least a `WORTH` chance of being accepted: n drafts while
alpha ** n >= WORTH. The estimate follows each verification (every accepted draft a
success, the first rejected one a failure) and, when drafts were held back, the token the
model produced where the first held-back draft would have stood: a free observation, so a
request that stopped drafting starts again once its text starts repeating.

Only ever fewer drafts than the proposer offers: the scheduler's contract (drafts are
`scheduled_spec_decode_tokens`, any count up to k) is unchanged, and so are greedy
outputs. Plain numpy and Python, deterministic: the same tokens give the same drafts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# A draft is sent while the chance that it and the drafts before it are all accepted is at
# least this. A draft row costs about 1/20 of a 4-request decode step on the CPU (fp32,
# oneDNN); replaying spec_bench's greedy outputs through the policy with that cost, 0.3
# lost least on text that does not repeat and gave up least on text that does (0.2 and
# 0.25 sent more rejected drafts; both are within a few percent).
WORTH = 0.3
# A new request's estimate: one draft at first (PRIOR ** 1 >= WORTH > PRIOR ** 2), more as
# they land.
PRIOR = 0.3
# Weight of each new observation in the estimate (an exponential moving average): the
# estimate follows a request from copying into free text (and back) within a few steps.
WEIGHT = 0.5


class DraftLimiter:
    """Per batch row: the acceptance estimate and the last full proposal."""

    def __init__(self, max_rows: int) -> None:
        self.alpha = np.full(max_rows, PRIOR)
        self.proposal: list[list[int]] = [[] for _ in range(max_rows)]

    def reset(self, row: int) -> None:
        """A request (new, or resumed after preemption) takes over `row`."""
        self.alpha[row] = PRIOR
        self.proposal[row] = []

    def observe(self, row: int, verified: Sequence[int], tokens: Sequence[int]) -> None:
        """Row `row` verified the drafts `verified` (maybe none) and emitted `tokens`
        (the accepted drafts, then one token of the model's own)."""
        if not tokens:
            return
        proposal = self.proposal[row]
        self.proposal[row] = []
        if any(d < 0 for d in verified):
            return  # placeholders the scheduler padded with, not the drafter's
        sent = len(verified)
        accepted = len(tokens) - 1
        alpha = float(self.alpha[row])
        for _ in range(min(accepted, sent)):
            alpha += WEIGHT * (1.0 - alpha)
        if accepted < sent:
            alpha -= WEIGHT * alpha
        elif len(proposal) > sent and list(proposal[:sent]) == list(verified):
            # every sent draft landed: did the first held-back one match the model's token?
            hit = proposal[sent] == tokens[-1]
            alpha += WEIGHT * ((1.0 if hit else 0.0) - alpha)
        self.alpha[row] = alpha

    def limit(self, row: int, proposal: list[int]) -> list[int]:
        """The part of `proposal` worth verifying; the rest is kept to learn from."""
        self.proposal[row] = proposal
        return proposal[: worth_sending(float(self.alpha[row]), len(proposal))]


def worth_sending(alpha: float, available: int) -> int:
    """The most drafts n <= available with alpha ** n >= WORTH."""
    if alpha >= 1.0:
        return available
    if alpha < WORTH:
        return 0
    return min(available, int(math.log(WORTH) / math.log(alpha) + 1e-9))
