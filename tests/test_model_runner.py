"""The model runner and LLMEngine on a tiny random model: timings, profiling, aborts,
streaming, KV sizing, and the same results on CUDA as on CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.config import RunnerOptions, parse_size
from engine.model.kv_cache import blocks_for_memory, bytes_per_block
from engine.model.threads import REPROBE_S, ThreadTuner
from engine.request import SamplingParams
from tests.model_support import needs_cuda, tiny_engine, tiny_model, tiny_spec

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_every_step_reports_its_timings() -> None:
    e = tiny_engine()
    e.add_request("a", "some prompt", GREEDY)
    e.add_request("b", "another prompt that is longer", GREEDY)
    steps = 0
    while e.has_unfinished():
        e.step()
        assert e.last_step is not None
        report = e.last_step.report
        assert len(report.timings) == 1
        t = report.timings[0]
        assert t.step == report.step
        assert min(t.prepare_ns, t.forward_ns, t.sample_ns) >= 0
        assert t.attention_ns is not None and 0 < t.attention_ns <= t.forward_ns
        assert t.kernels == ()
        steps += 1
    assert steps == 12


def test_profile_every_n_steps_adds_a_per_operator_breakdown() -> None:
    e = tiny_engine(options=RunnerOptions(num_gpu_blocks_override=64, profile_every=3))
    e.add_request("a", "profile me", SamplingParams(max_tokens=7, temperature=0.0))
    profiled = []
    while e.has_unfinished():
        e.step()
        assert e.last_step is not None
        t = e.last_step.report.timings[0]
        if t.kernels:
            profiled.append(t.step)
            names = {k.name for k in t.kernels}
            # the matrix products: torch's own, or oneDNN's on packed weights (CPU fp32)
            assert names & {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}
            assert all(k.calls > 0 and k.total_ns > 0 for k in t.kernels)
    assert profiled == [0, 3, 6]


def test_abort_finishes_one_request_and_frees_its_row() -> None:
    e = tiny_engine()
    e.add_request("keep", "first", GREEDY)
    e.add_request("drop", "second", SamplingParams(max_tokens=50))
    e.step()
    e.step()
    assert e.abort("drop") and not e.abort("drop") and not e.abort("unknown")
    assert e.output("drop").finish_reason == "abort"
    assert "drop" not in e.runner.batch.row_of
    while e.has_unfinished():
        e.step()
    assert e.output("keep").finish_reason == "length"
    assert len(e.output("keep").output_token_ids) == 12


def test_stream_yields_growing_outputs_and_generate_keeps_order() -> None:
    e = tiny_engine()
    seen: dict[str, list[int]] = {}
    for out in e.stream(["one", "two two"], SamplingParams(max_tokens=4, temperature=0.0)):
        previous = seen.get(out.request_id, [])
        assert out.output_token_ids[: len(previous)] == previous
        seen[out.request_id] = out.output_token_ids
    assert all(len(v) == 4 for v in seen.values()) and len(seen) == 2
    outs = tiny_engine().generate(["b", "a", "c"], [GREEDY, GREEDY, SamplingParams(max_tokens=3)])
    assert [len(o.output_token_ids) for o in outs] == [12, 12, 3]
    assert all(o.finished and o.first_token_time is not None for o in outs)
    assert all(o.first_token_time >= o.arrival_time for o in outs if o.first_token_time)
    assert len(outs[0].token_times) == 12
    assert outs[0].text == e.tokenizer.decode(outs[0].output_token_ids)


def test_same_greedy_tokens_whatever_the_batching() -> None:
    model = tiny_model(seed=8)
    prompts = ["alpha " * 9, "beta", "gamma gamma " * 5, "delta"]
    plain = [o.output_token_ids for o in tiny_engine(model).generate(prompts, GREEDY)]
    chunked = tiny_engine(model, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    assert [o.output_token_ids for o in chunked.generate(prompts, GREEDY)] == plain
    tight = tiny_engine(
        model,
        options=RunnerOptions(num_gpu_blocks_override=10),
        block_size=8,
        enable_prefix_caching=False,
    )
    outs = tight.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == plain
    assert sum(o.num_preemptions for o in outs) > 0


def test_stop_tokens_eos_and_max_tokens() -> None:
    model = tiny_model(seed=8)
    first = tiny_engine(model).generate(["stop here"], GREEDY)[0].output_token_ids
    stop_at = first[4]
    out = tiny_engine(model).generate(
        ["stop here"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_at,))
    )[0]
    assert out.finish_reason == "stop" and out.output_token_ids == first[: first.index(stop_at) + 1]
    model.tokenizer.eos_token_id = stop_at
    out = tiny_engine(model).generate(["stop here"], GREEDY)[0]
    assert out.finish_reason == "stop" and out.output_token_ids[-1] == stop_at
    ignored = tiny_engine(model).generate(
        ["stop here"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    assert ignored.output_token_ids == first and ignored.finish_reason == "length"


def test_kv_cache_is_sized_from_the_memory_budget() -> None:
    spec = tiny_spec()
    per_block = bytes_per_block(spec, 16, torch.float32)
    assert per_block == 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4
    assert blocks_for_memory(per_block * 10 + 5, spec, 16, torch.float32) == 10
    e = tiny_engine(options=RunnerOptions(kv_cache_memory=per_block * 40))
    assert e.config.num_blocks == 40
    assert e.runner.kv.layers[0][0].shape == (40, 16, spec.num_kv_heads, spec.head_dim)
    assert len(e.runner.kv.layers) == spec.num_layers
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("512MB") == 512 * 10**6
    assert parse_size(4096) == 4096 and parse_size("1.5k") == 1500
    for bad in ("lots", "-1", "0", "3XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_model_modules_keep_torch_out_of_the_command_line() -> None:
    code = (
        "import sys, tui.cli, engine.model.api, engine.model.workload, "
        "engine.model.errors, engine.config; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.cuda
@needs_cuda
def test_cuda_engine_gives_the_cpu_engines_tokens() -> None:
    model = tiny_model(seed=8)
    prompts = ["alpha " * 9, "beta", "gamma gamma " * 5]
    cpu = [o.output_token_ids for o in tiny_engine(model).generate(prompts, GREEDY)]
    cuda = tiny_engine(
        model,
        options=RunnerOptions(device="cuda", dtype="float32", num_gpu_blocks_override=64),
        max_num_batched_tokens=16,
    )
    assert cuda.runner.model.attention.name == "triton"
    outs = cuda.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == cpu
    timings = cuda.runner.flush_timings()
    assert all(t.forward_ns >= 0 for t in timings)


def test_thread_tuner_keeps_the_faster_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.get_num_threads()
    try:
        tuner = ThreadTuner(max_threads=2)
        speeds = {2: 0.05, 1: 0.01}  # a busy machine: one thread wins
        monkeypatch.setattr(tuner, "_time", lambda n: speeds[n])
        assert tuner.maybe_probe(now=100.0) == 1 and torch.get_num_threads() == 1
        speeds.update({2: 0.006})  # quiet again, but too soon to measure
        assert tuner.maybe_probe(now=100.0 + REPROBE_S / 2) == 1
        assert tuner.maybe_probe(now=100.0 + REPROBE_S) == 2
        assert torch.get_num_threads() == 2
        assert ThreadTuner(max_threads=1).probe() == 1
    finally:
        torch.set_num_threads(original)


def test_thread_tuner_is_not_fooled_by_a_burst_during_one_count_s_timings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server's client wakes right after each step, when the runner probes: a burst that
    slows the first timings taken must not make the tuner leave the faster count."""
    original = torch.get_num_threads()
    try:
        tuner = ThreadTuner(max_threads=2)
        taken: list[int] = []

        def timed(n: int) -> float:
            taken.append(n)
            burst = len(taken) <= 2  # the first two timings overlap other work
            return {2: 0.010, 1: 0.018}[n] * (5.0 if burst else 1.0)

        monkeypatch.setattr(tuner, "_time", timed)
        assert tuner.probe() == 2 and torch.get_num_threads() == 2
        assert taken.count(1) == taken.count(2) > 1 and taken[:2] != taken[2:4]  # interleaved
        # A count only a little faster is not worth a switch, and not worth flapping over.
        monkeypatch.setattr(tuner, "_time", lambda n: {2: 0.010, 1: 0.0095}[n])
        assert tuner.probe() == 2
    finally:
        torch.set_num_threads(original)
