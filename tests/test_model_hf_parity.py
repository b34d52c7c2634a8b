"""The real default model against Hugging Face transformers loading the same GGUF file.

Greedy outputs must be token-identical in four set-ups that each exercise one path of
the engine (and the tests check that the path really ran): a plain run, chunked prefill
mixed with decodes, preemption by recompute, and prefix-cache hits. Last-token logits
must match within 1e-4 relative in fp32."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch

from engine.config import EngineConfig, RunnerOptions
from engine.model.llm_engine import LLMEngine
from engine.records import Kind
from engine.request import SamplingParams
from tests.model_support import default_model, hf_oracle, needs_default_model

pytestmark = [pytest.mark.slow, pytest.mark.model, needs_default_model]

NEW_TOKENS = 64
PAD = 2  # SmolLM2's padding token (its EOS)
SYSTEM = (
    "You are a careful assistant who writes in plain English. Keep answers well "
    "organised, explain any technical term the first time you use it, prefer concrete "
    "examples over abstractions, and never invent facts: if you are unsure, say so. "
    "When asked for a list, give short items."
)
QUESTIONS = [
    "What is the capital of France?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright while it moves, step by step.",
    "List five ideas for a rainy weekend.",
    "Why do onions make people cry?",
    "Describe the water cycle for a ten-year-old, with an example from everyday life.",
    "hi",
    "Compare tea and coffee: caffeine, taste, and how each is prepared around the world.",
]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@functools.cache
def prompts() -> list[list[int]]:
    tok = default_model().tokenizer
    return [tok.apply_chat_template(chat(q)) for q in QUESTIONS]


@functools.cache
def hf_greedy() -> list[list[int]]:
    """transformers' own greedy generate() on the eight prompts (one left-padded batch,
    its own KV cache), without stopping at EOS."""
    model = hf_oracle()
    width = max(len(p) for p in prompts())
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts()])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts()])
    config = model.generation_config
    saved = (config.eos_token_id, config.pad_token_id)
    # No EOS: run all 64 tokens, as ignore_eos does on our side. (A generation_config
    # passed to generate() is merged with this one, and None would not override it.)
    config.eos_token_id, config.pad_token_id = None, PAD
    try:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS
            )
    finally:
        config.eos_token_id, config.pad_token_id = saved
    return [row[width:] for row in out.tolist()]


def engine(options: RunnerOptions | None = None, **config: Any) -> LLMEngine:
    base: dict[str, Any] = dict(
        block_size=16, max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=2048
    )
    base.update(config)
    return LLMEngine(
        default_model(), EngineConfig(**base), options or RunnerOptions(num_gpu_blocks_override=512)
    )


def run_greedy(e: LLMEngine) -> tuple[list[list[int]], list[Any]]:
    """All eight prompts at once, to the end; returns the outputs and every step report."""
    # the CPU default: the C kernel over the paged cache (decodes and short chunks)
    assert e.runner.model.attention.name == "cpu"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts()):
        e.add_request(f"q{i}", ids, params)
    reports = []
    while e.has_unfinished():
        e.step()
        assert e.last_step is not None
        reports.append(e.last_step.report)
    return [e.output(f"q{i}").output_token_ids for i in range(len(QUESTIONS))], reports


def assert_same_tokens(ours: list[list[int]]) -> None:
    for i, (got, want) in enumerate(zip(ours, hf_greedy())):
        assert got == want, (
            f"prompt {i} ({QUESTIONS[i]!r}) diverges at token "
            f"{next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(got))}"
        )


def test_greedy_plain_run_matches_transformers() -> None:
    ours, reports = run_greedy(engine(enable_prefix_caching=False))
    assert all(not r.preemptions for r in reports)
    assert_same_tokens(ours)


def test_greedy_chunked_prefill_mixed_with_decodes_matches_transformers() -> None:
    ours, reports = run_greedy(
        engine(
            max_num_batched_tokens=32, long_prefill_token_threshold=16, enable_prefix_caching=False
        )
    )
    mixed = [r for r in reports if {s.kind for s in r.scheduled} >= {Kind.CHUNK, Kind.DECODE}]
    assert len(mixed) >= 5, "prefill chunks never shared a step with decodes"
    assert max(r.num_scheduled_tokens for r in reports) <= 32
    assert_same_tokens(ours)


def test_greedy_with_preemptions_matches_transformers() -> None:
    e = engine(RunnerOptions(num_gpu_blocks_override=24), enable_prefix_caching=False)
    ours, reports = run_greedy(e)
    preemptions = sum(len(r.preemptions) for r in reports)
    assert preemptions >= 5, f"only {preemptions} preemptions"
    assert sum(e.output(f"q{i}").num_preemptions for i in range(8)) == preemptions
    assert_same_tokens(ours)


def test_greedy_with_prefix_cache_hits_matches_transformers() -> None:
    e = engine(enable_prefix_caching=True)
    ours, reports = run_greedy(e)
    hits = sum(a.cached_tokens for r in reports for a in r.admissions)
    shared_blocks = len(os.path.commonprefix(prompts())) // 16
    assert shared_blocks >= 3
    assert hits >= 7 * shared_blocks * 16, f"only {hits} prefix-hit tokens"
    assert all(e.output(f"q{i}").num_cached_tokens > 0 for i in range(1, 8))
    assert_same_tokens(ours)


def test_last_token_logits_match_transformers() -> None:
    """Each prompt prefilled in chunks of 32 tokens through the paged cache; the logits
    of its last token against transformers' full forward pass."""
    e = engine(max_num_batched_tokens=32, enable_prefix_caching=False)
    captured: list[torch.Tensor] = []
    compute = e.runner.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        captured.append(logits.clone())
        return logits

    e.runner.model.compute_logits = capture  # type: ignore[method-assign]
    model = hf_oracle()
    for i, ids in enumerate(prompts()):
        captured.clear()
        e.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
        assert len(captured) == 1
        with torch.inference_mode():
            want = model(torch.tensor([ids])).logits[0, -1].float()
        got = captured[0][0]
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-4, f"prompt {i}: relative error {rel:.2e}"
