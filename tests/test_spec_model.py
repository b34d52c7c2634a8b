"""Speculative decoding on the real default model: greedy outputs are token-identical with
n-gram drafts on and off, for prompts that repeat themselves (drafts accepted) and prompts
that do not (drafts rejected), under chunked prefill, preemption with drafts in flight and
prefix hits; the spec run's trace reads, gives stats and re-simulates exactly. A tiny
random model covers the sampled path and the run command's option."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from engine.config import EngineConfig, RunnerOptions, SpeculativeConfig
from engine.model.llm_engine import LLMEngine
from engine.records import Kind
from engine.request import SamplingParams
from recorder.recorder import open_recording
from replays.resim import resimulate
from replays.stats import trace_stats
from tests.model_support import default_model, needs_default_model, tiny_engine

NGRAM = SpeculativeConfig(
    "ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1
)
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. All that glitters is not gold. "
)
PROMPTS = {
    "copy": "Repeat this text exactly, twice:\n\n" + PASSAGE,
    "copy-more": "Repeat this text exactly, twice:\n\n" + PASSAGE + "Fortune favours the bold.",
    "poem": "Write a short poem about the sea.",
    "mars": "List three facts about Mars.",
}


@dataclass
class Run:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    accepted: int = 0  # drafts accepted
    rejected: int = 0  # drafts verified and rejected
    preemptions: int = 0
    preempted_with_drafts: int = 0  # victims that had drafts proposed or in flight
    hit_tokens: int = 0  # prefix-cache hits
    chunks: int = 0  # partial prefill entries


def run(engine: LLMEngine, prompts: dict[str, str], params: SamplingParams) -> Run:
    for rid, text in prompts.items():
        engine.add_request(rid, [{"role": "user", "content": text}], params)
    out = Run()
    drafting: set[int] = set()  # requests (refs) holding unverified drafts
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out.outputs[o.request_id] = o.output_token_ids
        rep = engine.last_step.report  # type: ignore[union-attr]
        for p in rep.preemptions:
            out.preemptions += 1
            out.preempted_with_drafts += p.victim in drafting
        accepted = {a.ref: a.accepted for a in rep.spec_accepted}
        for s in rep.scheduled:
            out.chunks += s.kind == Kind.CHUNK
            if s.ref in accepted:
                out.accepted += accepted[s.ref]
                out.rejected += s.num_spec_tokens - accepted[s.ref]
            drafting.discard(s.ref)
        drafting |= {p.ref for p in rep.spec_proposed}
        out.hit_tokens += sum(a.cached_tokens for a in rep.admissions)
    engine.close()
    return out


def engine(spec: SpeculativeConfig | None) -> LLMEngine:
    # A small budget chunks the prompts; 11 blocks of 16 cannot hold four requests'
    # outputs, so decoding preempts; the two "copy" prompts share a cached prefix.
    cfg = EngineConfig(
        block_size=16,
        max_num_batched_tokens=48,
        max_num_seqs=4,
        max_model_len=512,
        speculative_config=spec,
    )
    return LLMEngine(default_model(), cfg, RunnerOptions(num_gpu_blocks_override=11))


@pytest.mark.slow
@pytest.mark.model
@needs_default_model
def test_greedy_outputs_are_identical_with_drafts_on_and_off(tmp_path: Path) -> None:
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    plain = run(engine(None), PROMPTS, greedy)
    spec_engine = engine(NGRAM)
    path = tmp_path / "spec.trace"
    open_recording(spec_engine.core, path, kind="run")
    spec = run(spec_engine, PROMPTS, greedy)

    assert spec.outputs == plain.outputs
    assert spec.accepted > 0 and spec.rejected > 0
    assert spec.preemptions > 0
    assert spec.hit_tokens > 0 and spec.chunks > 0

    stats = trace_stats(path)
    assert stats.spec_drafts == spec.accepted + spec.rejected
    assert stats.spec_accepted == spec.accepted
    result = resimulate(path)
    assert result.mode == "faithful" and result.reproduced, result.divergence
    assert resimulate(path, scripted=True).reproduced


def test_preempting_requests_with_drafts_in_flight_changes_no_greedy_token() -> None:
    """Tiny blocks and a small pool: decoding preempts requests that hold drafts; they
    resume by recompute and still produce exactly the tokens of a run without drafts."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": "abc abc abc abc " * (1 + i % 2) + str(i) for i in range(5)}

    def tiny(spec: SpeculativeConfig | None) -> LLMEngine:
        return tiny_engine(
            options=RunnerOptions(num_gpu_blocks_override=40),
            block_size=4,
            max_num_batched_tokens=32,
            max_num_seqs=5,
            speculative_config=spec,
        )

    plain = run(tiny(None), prompts, greedy)
    spec = run(tiny(NGRAM), prompts, greedy)
    assert spec.outputs == plain.outputs
    assert spec.preempted_with_drafts > 0
    assert spec.accepted > 0 and spec.rejected > 0


def test_sampled_requests_with_drafts_run_and_seeded_ones_repeat() -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)
    prompts = {"a": "abc abc abc abc abc abc", "b": "one two one two one two"}
    first = run(tiny_engine(speculative_config=NGRAM), prompts, params)
    again = run(tiny_engine(speculative_config=NGRAM), prompts, params)
    assert first.outputs == again.outputs
    assert all(len(t) == 24 for t in first.outputs.values())
    assert first.accepted + first.rejected > 0


def test_the_runner_refuses_the_simulated_drafter() -> None:
    from engine.model.errors import ModelError

    with pytest.raises(ModelError, match="--speculative-config"):
        tiny_engine(num_speculative_tokens=2)


def test_run_takes_speculative_config(tmp_path: Path) -> None:
    from engine.model.api import build_engine
    from engine.model.workload import parse_run_workload
    from tests.model_support import tiny_model

    w = parse_run_workload(
        {
            "config": {"speculative_config": json.loads(json.dumps(NGRAM.__dict__))},
            "requests": [{"id": "r", "prompt": "hi hi hi hi", "sampling": {"max_tokens": 4}}],
        },
        "test",
    )
    e = build_engine(w, loaded=tiny_model(), overrides={"num_gpu_blocks_override": 64})
    assert e.config.speculative_config == NGRAM and e.config.num_speculative_tokens == 4
    # The command line gives it as JSON text, which replaces the workload's.
    text = '{"method": "ngram", "num_speculative_tokens": 2}'
    e = build_engine(w, loaded=tiny_model(), overrides={"speculative_config": text})
    assert e.config.speculative_config == SpeculativeConfig("ngram", 2, 5, 5)
    assert e.config.num_speculative_tokens == 2
    with pytest.raises(Exception, match="speculative_config.method='eagle'"):
        build_engine(
            w,
            loaded=tiny_model(),
            overrides={"speculative_config": '{"method": "eagle", "num_speculative_tokens": 2}'},
        )


def test_adaptive_drafts_verify_fewer_drafts_and_change_no_greedy_token() -> None:
    """Drafts that keep being rejected stop being sent (the tiny random model rarely
    repeats its prompt); the tokens stay those of a run without drafts."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": "abc abc abc abc " * (1 + i % 2) + str(i) for i in range(4)}

    def tiny(spec: SpeculativeConfig | None, adaptive: bool = True) -> LLMEngine:
        options = RunnerOptions(num_gpu_blocks_override=64, adaptive_drafts=adaptive)
        return tiny_engine(options=options, max_num_seqs=4, speculative_config=spec)

    plain = run(tiny(None), prompts, greedy)
    every = run(tiny(NGRAM, adaptive=False), prompts, greedy)
    adaptive = run(tiny(NGRAM), prompts, greedy)
    assert every.outputs == plain.outputs == adaptive.outputs
    assert every.rejected > 0
    assert adaptive.accepted + adaptive.rejected < every.accepted + every.rejected
    assert adaptive.rejected < every.rejected


def test_adaptive_drafts_is_a_runner_option() -> None:
    from engine.model.api import build_engine
    from engine.model.workload import parse_run_workload
    from engine.workload_file import WorkloadError
    from tests.model_support import tiny_model

    w = parse_run_workload(
        {
            "config": {"speculative_config": json.loads(json.dumps(NGRAM.__dict__))},
            "requests": [{"id": "r", "prompt": "hi hi hi hi", "sampling": {"max_tokens": 4}}],
        },
        "test",
    )
    base = {"num_gpu_blocks_override": 64, "device": "cpu"}
    # the default: on for the CPU (a GPU, where draft rows are nearly free, sends all)
    assert build_engine(w, loaded=tiny_model(), overrides=base).runner.limiter is not None
    off = build_engine(w, loaded=tiny_model(), overrides={**base, "adaptive_drafts": False})
    assert off.runner.limiter is None
    with pytest.raises(WorkloadError, match="adaptive_drafts='yes'"):
        build_engine(w, loaded=tiny_model(), overrides={**base, "adaptive_drafts": "yes"})
