"""The vLLM side of `schedtop resim --engine vllm`: runs in an interpreter that has vLLM.

    python -m replays.vllm_driver TRACE OUT [KEY=VALUE ...]
    python -m replays.vllm_driver --workload WORKLOAD.json OUT

Drives the installed vLLM's own scheduler (vLLM's Scheduler or AsyncScheduler, with
schedtop's recording taps: recorder.vllm) with a trace's inputs, or a simulation
workload's, and records what it decides into OUT. No model is loaded: a tiny config.json
stands in for one, and a scripted runner gives each request the tokens the trace says
it sampled, like `schedtop resim`'s scripted runner. The engine loop is vLLM's
EngineCore's, step for step: schedule, execute, (aborts that came in meanwhile), update;
with async scheduling, two batches in flight.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, parse_setting
from engine.driver import RequestScript, StepDriver, step_limit
from recorder.reader import TraceReader
from recorder.schema import Footer
from replays.scripts import RecordedInputs, collect_scripts

_TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 1 << 20,  # workloads use token ids up to here
    "max_position_embeddings": 1 << 22,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
}


@dataclass
class Inputs:
    """Everything a run needs."""

    config: EngineConfig  # the scheduler config
    scripts: list[RequestScript] = field(default_factory=list)  # in arrival order
    num_steps: int = 0  # recorded steps (0: run until done)
    footer: Footer | None = None  # the recording's (None: killed, or a workload)
    overrides: dict[str, Any] = field(default_factory=dict)  # --set: a what-if
    max_steps: int = 0  # give up here (0: the step limit for num_steps)


def tiny_model_dir() -> str:
    d = Path(tempfile.gettempdir()) / "schedtop_vllm_tiny_llama_v2"
    d.mkdir(exist_ok=True)
    path = d / "config.json"
    if not path.exists():
        tmp = d / f"config.json.{os.getpid()}"
        tmp.write_text(json.dumps(_TINY_MODEL))
        os.replace(tmp, path)
    return str(d)


def vllm_configs(cfg: EngineConfig) -> tuple[Any, Any]:
    """vLLM's VllmConfig and KVCacheConfig for schedtop's config."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(
        model=tiny_model_dir(),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
    )
    sched_kwargs: dict[str, Any] = dict(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        is_encoder_decoder=False,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=cfg.long_prefill_token_threshold_adaptive,
        policy=cfg.policy,
        async_scheduling=cfg.async_scheduling,
        watermark=cfg.watermark,
        scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
    )
    if cfg.max_num_active_seqs is not None:
        sched_kwargs["max_num_active_seqs"] = cfg.max_num_active_seqs
    cache = CacheConfig(
        block_size=cfg.block_size,
        cache_dtype="auto",
        enable_prefix_caching=cfg.enable_prefix_caching,
    )
    config = VllmConfig(
        scheduler_config=SchedulerConfig(**sched_kwargs),
        model_config=model,
        cache_config=cache,
        # The CUDA wheel finds no platform on a CPU-only host; naming the device keeps
        # vLLM on its platform-neutral path.
        device_config=DeviceConfig(device="cpu"),
    )
    spec = FullAttentionSpec(
        block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=cfg.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    cache.num_gpu_blocks = cfg.num_blocks
    return config, kv


def inputs_from_trace(path: str | Path, overrides: dict[str, Any]) -> Inputs:
    """A trace's inputs: config, arrivals, sampled tokens per request, aborts."""
    with TraceReader(path) as reader:
        header = reader.header
        if header.redacted:
            raise SystemExit(
                f"{path}: a redacted trace has no token ids; vLLM's scheduler hashes "
                "prompts itself, so it cannot be re-simulated with --engine vllm"
            )
        if header.first_step != 0:
            raise SystemExit(f"{path}: the trace starts mid-run (step {header.first_step})")
        recorded = {k: v for k, v in header.config.items() if k != "max_steps"}
        try:
            config = EngineConfig.from_dict({**recorded, **overrides})
        except ValueError as e:
            raise SystemExit(f"config: {e}") from None
        scripts, steps = collect_scripts(reader)
        footer = reader.footer
    return Inputs(config, scripts, steps, footer, overrides)


def inputs_from_workload(path: str | Path) -> Inputs:
    """A simulation workload (the fidelity cases' format) as inputs."""
    from engine.sim.driver import workload_scripts
    from engine.sim.workload import load_workload

    w = load_workload(path)
    return Inputs(w.config, workload_scripts(w), max_steps=w.max_steps)


class Driver:
    """vLLM's scheduler with the recording taps, driven like vLLM's EngineCore."""

    def __init__(self, inputs: Inputs, out: str | Path, scheduler_cls: Any = None) -> None:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.structured_output import StructuredOutputManager

        from recorder.vllm import RecordingScheduler

        self.inputs = inputs
        cfg = inputs.config
        os.environ["SCHEDTOP_TRACE_FILE"] = str(out)
        vllm_config, kv = vllm_configs(cfg)
        cls = scheduler_cls or RecordingScheduler
        self.sched = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv,
            block_size=cfg.block_size,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(vllm_config),
        )
        del os.environ["SCHEDTOP_TRACE_FILE"]
        tap = self.sched._schedtop
        if tap is None or tap.is_async != cfg.async_scheduling:
            raise SystemExit(
                f"vLLM set async_scheduling={vllm_config.scheduler_config.async_scheduling}"
                f" (asked: {cfg.async_scheduling}); is VLLM_TARGET_DEVICE=cpu set?"
            )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(cfg.block_size, sha256)
        self.sampled: dict[str, int] = {}
        self.by_id: dict[str, RequestScript] = {}
        self.batches: deque[tuple[Any, Any]] = deque()

    def _request(self, s: RequestScript) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        a = s.arrival
        stops = list(a.sampling.stop_token_ids)
        params = SamplingParams(max_tokens=a.sampling.max_tokens, stop_token_ids=stops)
        eos = a.eos_token_id if not a.sampling.ignore_eos else None
        params.update_from_generation_config({}, eos)
        return Request(
            request_id=s.request_id,
            prompt_token_ids=list(a.prompt_token_ids or ()),
            sampling_params=params,
            pooling_params=None,
            arrival_time=a.arrival_time,
            priority=a.priority,
            block_hasher=self.hasher,
        )

    def _runner_output(self, out: Any) -> Any:
        """A scheduled request samples iff this step reaches the end of its known tokens;
        its next scripted token."""
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(out.num_scheduled_tokens)
        tokens: list[list[int]] = []
        for rid in ids:
            if self.sched.requests[rid].is_prefill_chunk:
                tokens.append([])
                continue
            n = self.sampled.get(rid, 0)
            script = self.by_id[rid].tokens
            tokens.append([script[n] if n < len(script) else 0])
            self.sampled[rid] = n + 1
        return ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=tokens
        )

    # -- the engine behind engine.driver's StepDriver --------------------------------------

    def add(self, s: RequestScript) -> None:
        self.by_id[s.request_id] = s
        self.sched.add_request(self._request(s))

    def abort(self, s: RequestScript) -> None:
        from vllm.v1.request import RequestStatus

        # One id per call: finish_requests iterates a set, in an order that follows the
        # hash seed, and aborts free blocks in the order they come (issue 25).
        if s.request_id in self.sched.requests:
            self.sched.finish_requests([s.request_id], RequestStatus.FINISHED_ABORTED)

    def unfinished(self) -> tuple[bool, bool]:
        return self.sched.has_unfinished_requests(), bool(self.batches)

    def step(self, mid_step: Callable[[], None] | None) -> None:
        if self.inputs.config.async_scheduling:
            self._step_async(mid_step)
        else:
            self._step_sync(mid_step)

    def run(self) -> int:
        """Run until every request is done (and the recorded steps are covered)."""
        inputs = self.inputs
        driver = StepDriver(
            self,
            RecordedInputs(
                inputs.scripts,
                inputs.num_steps or None,
                inputs.footer,
                inputs.overrides,
                run_to=inputs.num_steps - 1,
            ),
            inputs.max_steps or step_limit(inputs.num_steps),
            lambda step: SystemExit(f"still running at step {step}"),
        )
        try:
            for _ in driver.run():
                pass
        finally:
            self.sched.shutdown()
        return driver.step

    def _step_sync(self, mid_step: Callable[[], None] | None) -> None:
        # Without requests vLLM's EngineCore skips the step; schedtop's records an empty one.
        out = self.sched.schedule()
        mro = self._runner_output(out)
        if mid_step is not None:
            mid_step()
        self.sched.update_from_output(out, mro)

    def _step_async(self, mid_step: Callable[[], None] | None) -> None:
        sched = self.sched
        batches = self.batches
        if sched.has_requests():
            out = sched.schedule()
            batches.append((out, self._runner_output(out)))
            executed = out.total_num_scheduled_tokens > 0
            if len(batches) < 2 and (executed or sched.has_requests()):
                return
        elif not batches:
            out = sched.schedule()  # an empty step, as schedtop's engine records one
            batches.append((out, self._runner_output(out)))
        old_out, old_mro = batches.popleft()
        if mid_step is not None:
            mid_step()
        sched.update_from_output(old_out, old_mro)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "--workload":
        inputs = inputs_from_workload(argv[1])
        out = argv[2]
    elif len(argv) >= 2:
        overrides = dict(parse_setting(a) for a in argv[2:])
        inputs = inputs_from_trace(argv[0], overrides)
        out = argv[1]
    else:
        print(__doc__, file=sys.stderr)
        return 2
    steps = Driver(inputs, out).run()
    print(json.dumps({"steps": steps, "trace": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
