"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.sampler import Sampler, SamplingBatch, step_seed
from engine.request import SamplingParams
from tests.model_support import tiny_engine, tiny_model

CPU = torch.device("cpu")


def batch(params: list[SamplingParams], positions: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch.from_params(params, positions or [0] * len(params), CPU)


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 6))
def test_temperature_zero_is_argmax(seed: int, rows: int) -> None:
    logits = random_logits(rows, 50, seed)
    params = [SamplingParams(temperature=0.0) for _ in range(rows)]
    assert torch.equal(Sampler(CPU, seed)(logits, batch(params)), logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 10), temp=st.floats(0.1, 5.0))
def test_top_k_never_emits_a_token_outside_the_top_k(seed: int, k: int, temp: float) -> None:
    logits = random_logits(4, 40, seed)
    params = [SamplingParams(temperature=temp, top_k=k, seed=seed + i) for i in range(4)]
    allowed = logits.topk(k, dim=-1).indices
    sampler = Sampler(CPU, seed)
    for step in range(20):
        tokens = sampler(logits, batch(params, [step] * 4))
        assert all(int(t) in allowed[i].tolist() for i, t in enumerate(tokens))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.05, 0.95), temp=st.floats(0.2, 3.0))
def test_top_p_never_emits_a_token_outside_the_nucleus(
    seed: int, top_p: float, temp: float
) -> None:
    logits = random_logits(3, 30, seed)
    params = [SamplingParams(temperature=temp, top_p=top_p) for _ in range(3)]
    probs = torch.softmax(logits / temp, dim=-1)
    sampler = Sampler(CPU, seed)
    for _ in range(20):
        tokens = sampler(logits, batch(params))
        for i, t in enumerate(tokens.tolist()):
            # The nucleus: every token whose more likely tokens hold less than top_p.
            before = probs[i][probs[i] > probs[i, t]].sum()
            assert before < top_p + 1e-6


def test_top_k_and_top_p_combine() -> None:
    logits = torch.tensor([[5.0, 4.9, 4.8, 0.0, -1.0]])
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.99)]
    sampler = Sampler(CPU, 0)
    seen = {int(sampler(logits, batch(params))) for _ in range(200)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(CPU, 1)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[int(sampler(logits, batch([SamplingParams(temperature=1.0)])))] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_seeded_row_does_not_depend_on_its_neighbours() -> None:
    logits = random_logits(1, 64, 3)
    alone = Sampler(CPU, 0)(logits, batch([SamplingParams(seed=42)], [5]))
    crowd_logits = torch.cat([random_logits(3, 64, 9), logits, random_logits(2, 64, 4)])
    crowd = [
        SamplingParams(),
        SamplingParams(top_k=3),
        SamplingParams(seed=1),
        SamplingParams(seed=42),
        SamplingParams(temperature=0.0),
        SamplingParams(),
    ]
    together = Sampler(CPU, 123)(crowd_logits, batch(crowd, [0, 1, 2, 5, 4, 0]))
    assert int(together[3]) == int(alone[0])


def test_step_seed_varies_with_position_and_seed() -> None:
    assert len({step_seed(s, p) for s in range(5) for p in range(5)}) == 25
    assert all(0 <= step_seed(s, p) < 2**63 for s in (0, 2**62, 2**64) for p in (0, 10**9))


def test_a_seeded_request_gives_the_same_tokens_in_any_batch() -> None:
    """End to end, on a tiny model: alone, then with other requests around it that join
    and leave at other times."""
    model = tiny_model(seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    alone = tiny_engine(model).generate(["the seeded one"], params)[0].output_token_ids
    e = tiny_engine(model, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    others = SamplingParams(max_tokens=9, temperature=1.0)
    e.add_request("a", "a neighbour with a long prompt " * 3, others)
    e.add_request("seeded", "the seeded one", params)
    e.add_request("b", "greedy neighbour", SamplingParams(max_tokens=30, temperature=0.0))
    for _ in range(3):
        e.step()
    e.add_request("c", "late", others)
    while e.has_unfinished():
        e.step()
    assert e.output("seeded").output_token_ids == alone
    assert len(alone) == 24
