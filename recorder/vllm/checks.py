"""What the vLLM recorder checks before it records, and how it names vLLM's settings.

vLLM versions and set-ups whose scheduling decisions schedtop's scheduler does not model
are refused at start-up (or, for a request that uses such a feature, stop the recording)
with a message, rather than recorded wrong. vLLM's scheduler config is mapped to
schedtop's EngineConfig under vLLM's own knob names.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from recorder.errors import RecordingError
from recorder.paths import make_trace_dir, trace_dir

SUPPORTED_VERSIONS = ("0.33.",)  # vLLM releases whose scheduler this module has been checked on

# What the taps call on vLLM objects: checked at start-up, so that a vLLM that moved
# them is refused with a message rather than recorded wrong.
REQUIRED = {
    "scheduler": (
        "_preempt_request",
        "kv_cache_manager",
        "running",
        "waiting",
        "requests",
        "max_num_scheduled_tokens",
        "max_model_len",
        "policy",
    ),
    "kv_cache_manager": ("allocate_slots", "free", "block_pool", "coordinator"),
    "block_pool": (
        "cache_full_blocks",
        "get_new_blocks",
        "get_num_free_blocks",
        "free_block_queue",
    ),
}


class UnsupportedVllm(RecordingError):
    """A vLLM version or set-up that this recorder would record wrong."""


def check_version(version: str) -> None:
    if not version.startswith(SUPPORTED_VERSIONS):
        raise UnsupportedVllm(
            "schedtop's vLLM recorder supports vLLM "
            + ", ".join(v + "x" for v in SUPPORTED_VERSIONS)
            + f"; this is vLLM {version}. Run without --scheduler-cls, or install a schedtop "
            "that supports this vLLM."
        )


def check_attributes(sched: Any, version: str) -> None:
    """Refuse a vLLM whose scheduler, KV cache manager or block pool lacks what the taps use."""
    kvm = getattr(sched, "kv_cache_manager", None)
    owners = {
        "scheduler": sched,
        "kv_cache_manager": kvm,
        "block_pool": getattr(kvm, "block_pool", None),
    }
    for what, names in REQUIRED.items():
        missing = [n for n in names if not hasattr(owners[what], n)]
        if missing:
            raise UnsupportedVllm(
                f"vLLM {version}: the {what} has no {', '.join(missing)}; "
                "schedtop's recorder cannot tap it"
            )


def setup_problems(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_bs: int
) -> list[str]:
    """Why this vLLM set-up cannot be recorded faithfully (empty: it can)."""
    sc = vllm_config.scheduler_config
    problems = []
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append("a KV connector (kv_transfer_config) is configured")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append("speculative decoding is on")
    if getattr(vllm_config, "lora_config", None) is not None:
        problems.append("LoRA is on (max_loras changes admission)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        problems.append(f"{len(groups)} KV cache groups (hybrid / sliding-window / Mamba models)")
    else:
        spec = type(groups[0].kv_cache_spec).__name__
        if spec != "FullAttentionSpec":
            problems.append(f"KV cache spec {spec} (only full attention is modelled)")
    if hash_bs != block_size:
        problems.append(f"hash_block_size {hash_bs} differs from block_size {block_size}")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism (more than two batches in flight)")
    if getattr(sc, "local_prefill_interval", 1) > 1:
        problems.append("local_prefill_interval > 1 (prefill throttling)")
    if getattr(vllm_config.cache_config, "deterministic_prefix_caching", False):
        problems.append("deterministic_prefix_caching (block-aligned prefill splits)")
    return problems


def request_problem(request: Any) -> str:
    """Why a request's scheduling cannot be recorded faithfully ("" if it can)."""
    if request.pooling_params is not None:
        return "a pooling request"
    if getattr(request, "mm_features", None):
        return "multimodal inputs (encoder budget)"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "use_structured_output", False):
        return "structured output (grammar compilation delays admission)"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(request, "cache_salt", None):
        return "a cache salt (prefix hashes schedtop does not compute)"
    if getattr(request, "resumable", False):
        return "a resumable (streaming session) request"
    return ""


def engine_config(
    sched: Any, async_scheduling: bool, block_size: int, num_blocks: int
) -> EngineConfig:
    """vLLM's scheduler config under schedtop's names."""
    vc = sched.vllm_config
    sc = vc.scheduler_config
    active = getattr(sched, "max_num_active_reqs", sc.max_num_seqs)
    return EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=sched.max_num_scheduled_tokens,
        max_num_seqs=sc.max_num_seqs,
        max_num_active_seqs=None if active == sc.max_num_seqs else active,
        max_model_len=sched.max_model_len,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=bool(
            getattr(sc, "long_prefill_token_threshold_adaptive", False)
        ),
        policy=str(sched.policy.value),
        enable_prefix_caching=bool(vc.cache_config.enable_prefix_caching),
        enable_chunked_prefill=bool(sc.enable_chunked_prefill),
        watermark=float(getattr(sc, "watermark", 0.0)),
        scheduler_reserve_full_isl=bool(getattr(sched, "scheduler_reserve_full_isl", True)),
        async_scheduling=async_scheduling,
    )


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise UnsupportedVllm(f"{name}={raw!r}: expected a number") from None


def data_parallel_rank(pc: Any) -> tuple[int, int | None] | None:
    """This engine core's data-parallel (rank, size), None without data parallelism; the
    size is None when vLLM no longer says it. vLLM 0.33 runs a dense (non-MoE) model's
    ranks as independent engines and resets each one's parallel config to DP=1
    (`reconfigure_for_independent_dp_rank`): the rank is left in `data_parallel_index`
    and in the engine-core process's name (`EngineCore_DP<rank>`), the size nowhere.
    Reading only `data_parallel_size` named no rank: every rank wrote an unranked file,
    and with a live port every rank asked for the same port."""
    size = int(getattr(pc, "data_parallel_size", 1) or 1)
    if size > 1:
        return int(getattr(pc, "data_parallel_rank", 0) or 0), size
    index = int(getattr(pc, "data_parallel_index", 0) or 0)
    m = re.fullmatch(r"EngineCore_DP(\d+)", multiprocessing.current_process().name)
    if index > 0:
        return index, None
    if m is not None:
        return int(m.group(1)), None
    return None


def trace_path(dp_rank: int | None) -> Path:
    exact = os.environ.get("SCHEDTOP_TRACE_FILE")  # one file, for drivers and tests
    if exact:
        return Path(exact)
    directory = trace_dir()
    make_trace_dir(directory)
    now = time.time_ns()
    seconds, rest = divmod(now, 1_000_000_000)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds))
    rank = f"-dp{dp_rank}" if dp_rank is not None else ""
    host = socket.gethostname().split(".")[0]
    return directory / f"{stamp}.{rest // 1_000_000:03d}-vllm-{host}-{os.getpid()}{rank}.trace"
