"""The vLLM side of scheduler_bench.py: runs under an interpreter that has vLLM.

Builds vLLM's own V1 Scheduler for one case of bench/_sched_workloads.py, drives it like
our side does, and prints {"us_per_step": ...}. Only the scheduler is exercised; no model
is loaded (a tiny config.json in a temp dir stands in for one)."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from bench._sched_workloads import CASES, CLOCKS, Case  # noqa: E402


def tiny_model_dir() -> str:
    d = Path(tempfile.gettempdir()) / "schedtop_bench_tiny_llama"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 32000,
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def build(case: Case) -> Scheduler:
    model = ModelConfig(
        model=tiny_model_dir(),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=65536,
    )
    sched_cfg = SchedulerConfig(
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.budget,
        max_model_len=65536,
        is_encoder_decoder=False,
        long_prefill_token_threshold=case.threshold,
    )
    cache = CacheConfig(block_size=case.block_size, cache_dtype="auto", enable_prefix_caching=True)
    config = VllmConfig(
        scheduler_config=sched_cfg,
        model_config=model,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
    )
    spec = FullAttentionSpec(
        block_size=case.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv = KVCacheConfig(
        num_blocks=case.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    cache.num_gpu_blocks = case.num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=case.block_size,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
    )


def run(case: Case, clock: str = "cpu") -> float:
    now = CLOCKS[clock]
    sched = build(case)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(case.block_size, sha256)
    rank = 0

    def add(length: int, max_tokens: int) -> None:
        nonlocal rank
        sched.add_request(
            Request(
                request_id=f"r{rank}",
                prompt_token_ids=case.prompt(rank, length),
                sampling_params=SamplingParams(max_tokens=max_tokens),
                pooling_params=None,
                arrival_time=float(rank),
                block_hasher=hasher,
            )
        )
        rank += 1

    for _ in range(case.num_decodes):
        add(8, 1_000_000)

    def step() -> float:
        if case.prefill_len:
            add(case.prefill_len, 4)
        t0 = now()
        out = sched.schedule()
        t1 = now()
        ids = list(out.num_scheduled_tokens)
        toks = [[] if sched.requests[r].is_prefill_chunk else [5] for r in ids]
        mro = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=toks
        )
        t2 = now()
        sched.update_from_output(out, mro)
        return (t1 - t0) + (now() - t2)

    for _ in range(3 + case.num_decodes * 8 // case.budget):
        step()
    return sum(step() for _ in range(case.steps)) / case.steps * 1e6


if __name__ == "__main__":
    case = next(c for c in CASES if c.name == sys.argv[1])
    print(json.dumps({"us_per_step": run(case, sys.argv[2] if len(sys.argv) > 2 else "cpu")}))
