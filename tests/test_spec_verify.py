"""Draft verification on hand-built logits: greedy keeps the longest matching prefix plus
the bonus token; rejection sampling at temperature 1 emits exactly the target
distribution (chi-square on a 5-token vocabulary, fixed seed, many samples)."""

from __future__ import annotations

import torch

from engine.model.sampler import Sampler
from engine.model.verify import Verification, verify
from engine.request import SamplingParams

# Chi-square critical value for 4 degrees of freedom at p = 0.001: a correct sampler
# fails this test once in a thousand seeds; the seed is fixed, so it never flakes.
CHI2_4_DOF_P001 = 18.47


def test_greedy_keeps_the_matching_prefix_and_the_bonus() -> None:
    logits = torch.full((7, 6), -5.0)
    for row, tok in enumerate([3, 1, 4, 0, 2, 5, 5]):
        logits[row, tok] = 5.0
    greedy = SamplingParams(temperature=0.0)
    v = Verification([[3, 1, 2], [5], []], [greedy] * 3, [0, 0, 0])
    # Request 0: rows 0-3 argmax 3 1 4 0; drafts 3 1 2 -> 3 1 accepted, then 4.
    # Request 1: rows 4-5 argmax 2 5; draft 5 rejected at once -> 2.
    # Request 2: row 6, no drafts -> 5.
    assert verify(logits, v, Sampler(torch.device("cpu"))) == [[3, 1, 4], [2], [5]]


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_emits_the_target_distribution() -> None:
    torch.manual_seed(0)
    target = torch.tensor(
        [
            [0.10, 0.40, 0.05, 0.30, 0.15],  # draft 1 (p = 0.40): often accepted
            [0.50, 0.05, 0.20, 0.15, 0.10],  # draft 4 (p = 0.10): mostly rejected
            [0.20, 0.20, 0.20, 0.20, 0.20],  # the bonus row
        ]
    )
    drafts = [1, 4]
    n = 40_000
    logits = target.log().repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    sampler = Sampler(torch.device("cpu"), seed=1234)
    out = verify(logits, Verification([drafts] * n, params, [0] * n), sampler)

    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=5).double()
    assert chi2(first, target[0].double()) < CHI2_4_DOF_P001
    # Given the first draft was accepted, the second token follows row 1; given both
    # were, the bonus follows row 2.
    after = [o for o in out if o[0] == drafts[0]]
    second = torch.bincount(torch.tensor([o[1] for o in after]), minlength=5).double()
    assert chi2(second, target[1].double()) < CHI2_4_DOF_P001
    both = [o for o in out if o[:2] == drafts]
    assert len(both) > 1000
    bonus = torch.bincount(torch.tensor([o[2] for o in both]), minlength=5).double()
    assert chi2(bonus, target[2].double()) < CHI2_4_DOF_P001
    # Acceptance rates are the drafts' target probabilities.
    assert abs(len(after) / n - 0.40) < 0.01
    assert abs(len(both) / len(after) - 0.10) < 0.01


def test_a_wrong_sampler_fails_the_test() -> None:
    """The test has power: always accepting the draft would emit token 1 at 100%."""
    counts = torch.tensor([0.0, 40_000.0, 0.0, 0.0, 0.0])
    assert chi2(counts, torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15]).double()) > CHI2_4_DOF_P001


def test_seeded_requests_verify_the_same_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeded = SamplingParams(temperature=0.8, seed=7)
    alone = verify(logits, Verification([[4, 9]], [seeded], [3]), Sampler(torch.device("cpu")))
    other = torch.randn(2, 50)
    mixed = verify(
        torch.cat([other, logits]),
        Verification([[1], [4, 9]], [SamplingParams(temperature=1.0), seeded], [0, 3]),
        Sampler(torch.device("cpu"), seed=99),
    )
    assert mixed[1] == alone[0]


def test_placeholder_drafts_are_rejected_and_the_token_follows_the_target() -> None:
    """A padding placeholder (-1) is never accepted; the token in its place is drawn from
    the target itself (greedy: its argmax), not from a residual."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [0.0, 0.0, 0.0, 9.0], [9.0, 0.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler(torch.device("cpu"))
    assert verify(logits, Verification([[-1, -1]], [greedy], [0]), sampler) == [[1]]
    target = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20_000
    out = verify(
        target.log().repeat(n, 1),
        Verification(
            [[-1]] * (n // 2), [SamplingParams(temperature=1.0)] * (n // 2), [0] * (n // 2)
        ),
        Sampler(torch.device("cpu"), seed=5),
    )
    assert all(len(o) == 1 for o in out)
    counts = torch.bincount(torch.tensor([o[0] for o in out]), minlength=4).double()
    expected = target.double() * counts.sum()
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27  # 3 dof, p = 0.001
