"""vLLM's logits processing in the sampler (issue 26): logit_bias, repetition, frequency
and presence penalties, min_p, and the sampled tokens' logprobs, on the tiny random model
end to end and on plain logits. Each test checks that the knob moves the output the way
its definition says."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from engine.model.errors import RequestError
from engine.model.sampler import Sampler, SamplingBatch, process_logits, token_logprobs
from engine.request import SamplingParams
from tests.model_support import tiny_engine, tiny_model

CPU = torch.device("cpu")
PROMPT = "the quick brown fox jumps over the lazy dog"


def generate(params: SamplingParams, prompt: str = PROMPT, **config: object) -> list[int]:
    engine = tiny_engine(tiny_model(seed=5), **config)  # type: ignore[arg-type]
    return engine.generate([prompt], params)[0].output_token_ids


def test_logit_bias_of_100_forces_a_token_greedy_and_sampled() -> None:
    token = 77
    greedy = generate(SamplingParams(max_tokens=12, temperature=0, logit_bias=((token, 100.0),)))
    sampled = generate(SamplingParams(max_tokens=12, temperature=1.0, logit_bias=((token, 100.0),)))
    assert greedy == [token] * 12 and sampled == [token] * 12
    banned = generate(SamplingParams(max_tokens=12, temperature=0))
    first = banned[0]
    without = generate(SamplingParams(max_tokens=12, temperature=0, logit_bias=((first, -100.0),)))
    assert first not in without


def test_frequency_and_presence_penalties_lower_repeats() -> None:
    plain = generate(SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    freq = generate(
        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, frequency_penalty=2.0)
    )
    pres = generate(
        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, presence_penalty=2.0)
    )
    top = Counter(plain).most_common(1)[0][1]
    assert top > 4, "the tiny model must repeat itself for this test to mean anything"
    assert Counter(freq).most_common(1)[0][1] < top
    assert len(set(pres)) > len(set(plain))
    # negative penalties favour repeats
    neg = generate(
        SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, frequency_penalty=-2.0)
    )
    assert len(set(neg)) <= len(set(plain))


def test_repetition_penalty_avoids_prompt_tokens() -> None:
    prompt_ids = tiny_engine(tiny_model(seed=5)).tokenize(PROMPT)
    plain = generate(SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    rep = generate(
        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=50.0)
    )
    in_prompt = set(prompt_ids)

    def reused(ids: list[int]) -> int:
        return sum(1 for t in ids if t in in_prompt) + len(ids) - len(set(ids))

    assert reused(rep) < reused(plain)


def test_penalties_follow_vllms_definitions_on_logits() -> None:
    vocab = 6
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0, 3.0]])
    prompt, output = np.array([0, 1]), np.array([2, 2, 3])
    params = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5,
        logit_bias=((5, -1.0),),
    )  # fmt: skip
    b = SamplingBatch.from_params([params], [3], CPU, lambda i: (prompt, output), vocab)
    got = process_logits(logits, b)[0].tolist()
    # bias first, then repetition (divide positives, multiply negatives: prompt and output
    # tokens), then frequency (times the output count) and presence (once in the output)
    want = [1.0, -4.0, 0.5 - 0.5 - 0.5, 0.25 - 0.25 - 0.5, 0.0, 2.0]
    assert got == pytest.approx(want)
    assert logits[0, 0] == 2.0  # the raw logits are untouched (logprobs read them)


def test_min_p_one_is_greedy_and_min_p_keeps_likely_tokens() -> None:
    greedy = generate(SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    minp = generate(SamplingParams(max_tokens=24, temperature=1.5, min_p=1.0, ignore_eos=True))
    assert minp == greedy
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    b = SamplingBatch.from_params([SamplingParams(min_p=0.5)], [0], CPU)
    probs = Sampler.probabilities(logits, b)[0]
    assert probs[2] == 0 and probs[3] == 0 and probs[:2].sum() == pytest.approx(1.0)


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_chosen_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    tokens = [4, 17, int(logits[2].argmax())]
    got = token_logprobs(logits, tokens, [2, None, 0])
    lp = torch.log_softmax(logits, dim=-1)
    a, none, c = got
    assert none is None and a is not None and c is not None
    assert a.logprob == pytest.approx(float(lp[0, 4]))
    assert a.rank == int((lp[0] > lp[0, 4]).sum()) + 1
    top = lp[0].topk(2)
    assert [t for t, _ in a.top] == top.indices.tolist()
    assert [v for _, v in a.top] == pytest.approx(top.values.tolist())
    assert c.rank == 1 and c.top == ()


def test_logprobs_end_to_end_match_the_models_logits() -> None:
    engine = tiny_engine(tiny_model(seed=5))
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3)
    out = engine.generate([PROMPT], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_token_ids)
    for lp, tok in zip(out.logprobs, out.output_token_ids):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][1] >= lp.logprob and lp.rank >= 1
    # The first token's logprob, from a forward pass of the prompt alone.
    first = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    lp0 = first[0].logprobs
    assert lp0 is not None and lp0[0].rank == 1  # greedy: the most likely token
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    assert plain[0].logprobs is None
    assert plain[0].output_token_ids == out.output_token_ids  # logprobs change nothing


def test_a_penalized_request_samples_the_same_next_to_others() -> None:
    """Rows are processed per request: a batch of mixed requests gives each the tokens
    it gets alone."""
    model = tiny_model(seed=5)
    pen = SamplingParams(max_tokens=20, temperature=0, frequency_penalty=1.5, ignore_eos=True)
    alone = tiny_engine(model).generate([PROMPT], pen)[0].output_token_ids
    e = tiny_engine(model)
    e.add_request("plain", "something else entirely", SamplingParams(max_tokens=20, temperature=0))
    e.add_request(
        "biased", "x", SamplingParams(max_tokens=5, temperature=0, logit_bias=((9, 100.0),))
    )
    e.add_request("pen", PROMPT, pen)
    while e.has_unfinished():
        e.step()
    assert e.output("pen").output_token_ids == alone
    assert e.output("biased").output_token_ids == [9] * 5


def test_bad_values_are_refused() -> None:
    for bad in (
        dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
        dict(repetition_penalty=0.0), dict(min_p=1.5), dict(logit_bias=((1, 101.0),)),
        dict(logprobs=21),
    ):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="logit_bias"):
        tiny_engine(tiny_model()).add_request("x", "hi", SamplingParams(logit_bias=((10**6, 1.0),)))


def test_a_workload_file_carries_the_new_sampling_keys() -> None:
    from engine.model.workload import parse_run_workload
    from engine.workload_file import WorkloadError

    sampling = {"max_tokens": 4, "frequency_penalty": 1, "presence_penalty": 0.5,
                "repetition_penalty": 1.1, "min_p": 0.1, "logit_bias": [[5, 3]],
                "logprobs": 2}  # fmt: skip
    w = parse_run_workload({"requests": [{"id": "a", "prompt": "hi", "sampling": sampling}]})
    params = SamplingParams(**w.requests[0].sampling)
    assert params.logit_bias == ((5, 3.0),) and params.frequency_penalty == 1.0
    assert params.logprobs == 2 and params.processes_logits
    bad = {"requests": [{"id": "a", "prompt": "hi", "sampling": {"logit_bias": [[5]]}}]}
    with pytest.raises(WorkloadError, match="logit_bias"):
        parse_run_workload(bad)


def test_with_speculative_decoding_processed_requests_sample_as_without() -> None:
    """Requests with logits processing or logprobs get no drafts, so their tokens are
    what a run without drafts gives; their neighbours still verify drafts."""
    from engine.config import SpeculativeConfig

    ngram = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                              prompt_lookup_max=3)  # fmt: skip
    special = {
        "pen": SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.0, logprobs=1
        ),  # fmt: skip
        "bias": SamplingParams(
            max_tokens=8, temperature=0.7, seed=4, ignore_eos=True, logit_bias=((40, 100.0),)
        ),  # fmt: skip
        "plain": SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
    }

    def run(spec: SpeculativeConfig | None) -> dict[str, Any]:
        e = tiny_engine(tiny_model(seed=5), speculative_config=spec)
        for rid, p in special.items():
            e.add_request(rid, "abc abc abc abc abc " + rid, p)
        while e.has_unfinished():
            e.step()
        return {rid: e.output(rid) for rid in special}

    plain, spec = run(None), run(ngram)
    for rid in special:
        assert spec[rid].output_token_ids == plain[rid].output_token_ids, rid
    assert spec["bias"].output_token_ids == [40] * 8
    lps = spec["pen"].logprobs
    assert lps is not None and [x.token_id for x in lps] == spec["pen"].output_token_ids
