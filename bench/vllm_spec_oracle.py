"""vLLM's V1 Scheduler driven with scripted n-gram drafts: the peer of `schedtop sim` with
a `speculative_config`. Runs in an interpreter that has vLLM (never a dependency).

    VLLM_PYTHON bench/vllm_spec_oracle.py < workloads.jsonl > decisions.jsonl

One workload per input line (the fidelity format, with config `speculative_config`), one
line of decisions out: {"steps": [...]} or {"error": "..."}.

The fake model is `engine.sim.runner.SimRunner`'s rule, restated here so that both
schedulers see the same drafts: a request samples when a step takes it to the end of its
known tokens; the scheduled drafts are accepted while they match its script, then one
more script token is emitted; after each sample, prompt lookup over the request's tokens
proposes the next drafts (vLLM's n-gram rule: the longest suffix match, its earliest
occurrence). Drafts reach vLLM the way its engine hands them over:
`update_draft_token_ids` after `update_from_output`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import logging  # noqa: E402
import warnings  # noqa: E402

warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

STALL_STEPS = 300  # steps with nothing scheduled after the last arrival: vLLM is stuck
_HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 1,
    "vocab_size": 32000,
    "max_position_embeddings": 1 << 22,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
}
_PASSTHROUGH = (
    "watermark",
    "scheduler_reserve_full_isl",
    "max_num_active_seqs",
    "long_prefill_token_threshold_adaptive",
    "enable_chunked_prefill",
)


def _model_dir() -> str:
    d = os.path.join(tempfile.gettempdir(), "schedtop_vllm_spec_oracle_model")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "config.json")
    if not os.path.exists(path):
        with open(path + ".tmp", "w") as f:
            json.dump(_HF, f)
        os.replace(path + ".tmp", path)
    return d


def build(cfg: dict) -> Scheduler:
    bs = int(cfg.get("block_size", 16))
    max_model_len = int(cfg.get("max_model_len", 8192))
    sc = cfg["speculative_config"]
    model = ModelConfig(
        model=_model_dir(),
        dtype="float16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    sched_kw = dict(
        max_num_seqs=int(cfg.get("max_num_seqs", 16)),
        max_num_batched_tokens=int(cfg.get("max_num_batched_tokens", 2048)),
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        long_prefill_token_threshold=int(cfg.get("long_prefill_token_threshold", 0)),
        policy=cfg.get("policy", "fcfs"),
    )
    sched_kw.update({key: cfg[key] for key in _PASSTHROUGH if cfg.get(key) is not None})
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=sc["num_speculative_tokens"],
        prompt_lookup_max=sc["prompt_lookup_max"],
        prompt_lookup_min=sc["prompt_lookup_min"],
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    cache = CacheConfig(
        block_size=bs,
        cache_dtype="auto",
        enable_prefix_caching=bool(cfg.get("enable_prefix_caching", True)),
    )
    config = VllmConfig(
        scheduler_config=SchedulerConfig(**sched_kw),
        model_config=model,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
        speculative_config=spec,
    )
    num_blocks = int(cfg["num_blocks"])
    cache.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        block_size=bs,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
    )


def propose(tokens: list[int], sc: dict, max_model_len: int) -> list[int]:
    """Prompt lookup: the k tokens after the earliest occurrence of the longest suffix
    n-gram, n from prompt_lookup_max down to prompt_lookup_min."""
    n_tok = len(tokens)
    k = min(sc["num_speculative_tokens"], max_model_len - n_tok)
    if k <= 0:
        return []
    for n in range(min(sc["prompt_lookup_max"], n_tok - 1), sc["prompt_lookup_min"] - 1, -1):
        suffix = tokens[n_tok - n :]
        for i in range(n_tok - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def run(workload: dict) -> list[dict]:
    cfg = workload["config"]
    sc = cfg["speculative_config"]
    sched = build(cfg)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(sched.block_size, sha256)
    specs = workload["requests"]
    order = sorted(range(len(specs)), key=lambda i: (int(specs[i].get("arrival_step", 0)), i))
    arrivals: dict[int, list] = {}
    for rank, i in enumerate(order):
        arrivals.setdefault(int(specs[i].get("arrival_step", 0)), []).append((rank, specs[i]))
    scripts: dict[str, list[int]] = {}
    sampled_n: dict[str, int] = {}
    unfinished: set[str] = set()
    preempted: list[str] = []
    preempted_for: list[str | None] = []
    allocating: list[str | None] = [None]
    orig = sched._preempt_request
    orig_allocate = sched.kv_cache_manager.allocate_slots

    def recording(request, *a, **kw):
        preempted.append(request.request_id)
        preempted_for.append(allocating[0])
        return orig(request, *a, **kw)

    def allocate(request, *a, **kw):
        allocating[0] = request.request_id
        return orig_allocate(request, *a, **kw)

    sched._preempt_request = recording
    sched.kv_cache_manager.allocate_slots = allocate
    last = max(arrivals, default=-1)
    steps: list[dict] = []
    step = idle = 0
    while step <= last or unfinished:
        if idle >= STALL_STEPS and step > last:
            raise SystemExit(f"stalled at step {step}")
        arrived = []
        for rank, s in arrivals.get(step, []):
            rid = str(s["id"])
            max_tokens = int(s.get("max_tokens", len(s.get("output_token_ids", []))))
            scripts[rid] = list(s.get("output_token_ids", []))
            sampled_n[rid] = 0
            sched.add_request(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(s["prompt_token_ids"]),
                    sampling_params=SamplingParams(max_tokens=max_tokens),
                    pooling_params=None,
                    arrival_time=float(rank),
                    priority=int(s.get("priority", 0)),
                    block_hasher=hasher,
                )
            )
            unfinished.add(rid)
            arrived.append(rid)
        preempted.clear()
        preempted_for.clear()
        before = {rid: r.status.name for rid, r in sched.requests.items()}
        out = sched.schedule()
        free_after = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        admitted = {
            rid: {
                "cached_tokens": sched.requests[rid].num_computed_tokens - n,
                "resumed": before.get(rid) == "PREEMPTED",
            }
            for rid, n in out.num_scheduled_tokens.items()
            if before.get(rid, "WAITING") in ("WAITING", "PREEMPTED")
        }
        ids = list(out.num_scheduled_tokens)
        tokens_out: list[list[int]] = []
        sampled: dict[str, int] = {}
        spec_rec: dict[str, list[int]] = {}
        for rid in ids:
            if sched.requests[rid].is_prefill_chunk:
                tokens_out.append([])
                continue
            pos, script = sampled_n[rid], scripts[rid]
            drafted = out.scheduled_spec_decode_tokens.get(rid, [])
            toks: list[int] = []
            for d in drafted:
                if d != (script[pos + len(toks)] if pos + len(toks) < len(script) else 0):
                    break
                toks.append(d)
            nxt = pos + len(toks)
            toks.append(script[nxt] if nxt < len(script) else 0)
            if drafted:
                spec_rec[rid] = [len(drafted), len(toks) - 1]
            sampled_n[rid] = pos + len(toks)
            tokens_out.append(toks)
            sampled[rid] = toks[-1]
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=tokens_out,
        )
        eco = sched.update_from_output(out, mro)
        finished = []
        for client in eco.values():
            for o in client.outputs:
                if o.new_token_ids:  # what vLLM kept: a stop trims the tokens after it
                    sampled[o.request_id] = o.new_token_ids[-1]
                if o.finish_reason is not None:
                    finished.append(o.request_id)
                    unfinished.discard(o.request_id)
        draft_ids = [r for r, t in zip(ids, tokens_out) if t and r in sched.requests]
        if draft_ids:
            drafts = [
                propose(list(sched.requests[r].all_token_ids), sc, sched.max_model_len)
                for r in draft_ids
            ]
            sched.update_draft_token_ids(DraftTokenIds(draft_ids, drafts))
        pool = sched.kv_cache_manager
        steps.append(
            {
                "step": step,
                "arrived": arrived,
                "scheduled": dict(out.num_scheduled_tokens),
                "preempted": list(preempted),
                "preemptions": [list(x) for x in zip(preempted, preempted_for)],
                "admitted": admitted,
                "sampled": sampled,
                "spec": spec_rec,
                "finished": finished,
                "num_free_blocks": pool.block_pool.get_num_free_blocks(),
                "num_free_blocks_after_schedule": free_after,
                "running": [r.request_id for r in sched.running],
                "waiting": [r.request_id for r in sched.kv_holding_waiting]
                + [r.request_id for r in sched.waiting],
                "num_computed_tokens": {
                    r: q.num_computed_tokens for r, q in sched.requests.items()
                },
                "block_tables": {
                    r: list(pool.get_block_ids(r)[0])
                    for r in sched.requests
                    if pool.get_block_ids(r)[0]
                },
            }
        )
        idle = 0 if out.num_scheduled_tokens else idle + 1
        step += 1
    return steps


def main() -> None:
    for line in sys.stdin:
        try:
            out = {"steps": run(json.loads(line))}
        except SystemExit as e:
            out = {"error": str(e)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
