"""The model runner: executes each SchedulerOutput on the real model (the Runner protocol).

One step: update the persistent input batch and build the flat inputs, run the forward
pass over the paged KV cache, compute logits only for the requests that reach the end of
their known tokens, sample, and report what it took."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from engine.config import EngineConfig, RunnerOptions
from engine.draft_limit import DraftLimiter
from engine.model.cpu_memory import keep_freed_memory
from engine.model.errors import ModelError
from engine.model.input_batch import InputBatch, StepInputs
from engine.model.kv_cache import (
    DEFAULT_CPU_KV_MEMORY,
    KVCache,
    blocks_for_memory,
    cuda_kv_memory,
)
from engine.model.llama import AttentionBackend, LlamaModel
from engine.model.loader import LoadedModel
from engine.model.sampler import (
    History,
    Sampler,
    SamplingBatch,
    process_logits,
    token_logprobs,
)
from engine.model.spec import ModelSpec
from engine.model.threads import ThreadTuner
from engine.model.timing import StepTimer, TimedAttention, kernel_stats
from engine.model.verify import Verification, verify
from engine.ngram import NgramProposer
from engine.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from engine.records import Timing


class ModelRunner:
    """Runs a LlamaModel for the scheduler, one SchedulerOutput at a time."""

    def __init__(
        self,
        model: LlamaModel,
        kv: KVCache,
        config: EngineConfig,
        options: RunnerOptions,
        timer: StepTimer,
        threads: ThreadTuner | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.config = config
        self.options = options
        self.timer = timer
        self.device = model.device
        self.batch = InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            config.block_size,
            config.max_num_batched_tokens,
            self.device,
        )
        self.sampler = Sampler(self.device, options.seed)
        spec = config.speculative_config
        self.proposer = (
            NgramProposer(
                spec.num_speculative_tokens,
                spec.prompt_lookup_min,
                spec.prompt_lookup_max,
                config.max_model_len,
            )
            if spec is not None
            else None
        )
        # A draft row costs a CPU step real work, and a GPU step next to nothing: by
        # default only the CPU holds drafts back (the limiter's bar is set from CPU costs).
        adaptive = options.adaptive_drafts
        if adaptive is None:
            adaptive = self.device.type == "cpu"
        self.limiter = (
            DraftLimiter(config.max_num_seqs) if self.proposer is not None and adaptive else None
        )
        self.threads = threads  # CPU only, when num_threads is not fixed

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.maybe_probe()
        timer = self.timer
        timer.begin(out.step)
        every = self.options.profile_every
        profiled = every > 0 and out.step % every == 0
        with torch.inference_mode(), self._profile(profiled) as prof:
            inputs = self.batch.prepare(out)
            if self.limiter is not None:
                for nr in out.scheduled_new_reqs:
                    self.limiter.reset(self.batch.row_of[nr.req_id])
            timer.mark("prepared")
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, inputs.meta, self.kv.layers
            )
            verified: list[list[int]] | None = None
            logprobs: list[TokenLogprobs | None] = []
            if len(inputs.sample_rows):
                logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
                timer.mark("forwarded")
                if inputs.drafts is not None:
                    verified, logprobs = self._verify(logits, inputs)
                else:
                    batch = SamplingBatch.from_params(
                        inputs.sample_params,
                        inputs.output_positions.tolist(),
                        self.device,
                        self._history(inputs.sample_rows),
                        self.spec.vocab_size,
                    )
                    tokens = self.sampler(logits, batch).cpu().numpy()
                    if batch.logprobs is not None:
                        logprobs = token_logprobs(logits, tokens.tolist(), batch.logprobs)
            else:  # every request is mid-prefill: nothing to sample
                timer.mark("forwarded")
                tokens = np.zeros(0, dtype=np.int64)
            timer.mark("sampled")
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        sampling = np.flatnonzero(inputs.sample_mask).tolist()
        if verified is not None:
            self.batch.append_verified(inputs.sample_rows, verified)
            for i, toks in zip(sampling, verified):
                sampled[i] = toks
        else:
            self.batch.append_sampled(inputs.sample_rows, tokens)
            for i, tok in zip(sampling, tokens.tolist()):
                sampled[i] = [tok]
        drafts, propose_s = self._propose(inputs, sampling, sampled)
        kernels = kernel_stats(prof, self.device.type == "cuda") if prof is not None else ()
        timings = timer.end(out.step, kernels, propose_s)
        by_req = {inputs.req_ids[i]: [lp] for i, lp in zip(sampling, logprobs) if lp is not None}
        return ModelRunnerOutput(inputs.req_ids, sampled, drafts, timings, by_req)

    def _history(self, rows: np.ndarray) -> History:
        """Row i of the sampling batch -> (its prompt, its output so far): what the
        penalties count. Read from the input batch only when some request has one."""
        batch = self.batch

        def tokens(i: int) -> tuple[np.ndarray, np.ndarray]:
            row = int(rows[i])
            n_prompt, n = int(batch.num_prompt[row]), int(batch.num_tokens[row])
            return batch.token_ids[row, :n_prompt], batch.token_ids[row, n_prompt:n]

        return tokens

    def _verify(
        self, logits: torch.Tensor, inputs: StepInputs
    ) -> tuple[list[list[int]], list[TokenLogprobs | None]]:
        """Drafts verified; requests with logits processing or logprobs verify none (see
        _propose), so their first row is theirs exactly, as in a step without drafts."""
        assert inputs.drafts is not None
        params = inputs.sample_params
        counts = [len(d) + 1 for d in inputs.drafts]
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        # A request's first row is exact when it has no real drafts: none, or only the
        # placeholders vLLM pads a one-token step with (always rejected).
        single = [j for j, d in enumerate(inputs.drafts) if all(x < 0 for x in d)]
        special = [
            j for j in single if params[j].processes_logits or params[j].logprobs is not None
        ]
        if special:
            rows = starts[special]
            batch = SamplingBatch.from_params(
                [params[j] for j in special],
                [int(inputs.output_positions[j]) for j in special],
                self.device,
                self._history(inputs.sample_rows[special]),
                self.spec.vocab_size,
            )
            if batch.processing is not None:
                index = torch.from_numpy(rows).to(logits.device)
                processed = logits.clone()
                processed[index] = process_logits(logits.index_select(0, index), batch)
                v_logits = processed
            else:
                v_logits = logits
        else:
            v_logits = logits
        v = Verification(inputs.drafts, params, inputs.output_positions.tolist())
        verified = verify(v_logits, v, self.sampler)
        logprobs: list[TokenLogprobs | None] = [None] * len(counts)
        wanted = [j for j in special if params[j].logprobs is not None]
        if wanted:
            got = token_logprobs(
                logits[starts[wanted]],
                [verified[j][0] for j in wanted],
                [params[j].logprobs for j in wanted],
            )
            for j, lp in zip(wanted, got):
                logprobs[j] = lp
        return verified, logprobs

    def _propose(
        self, inputs: StepInputs, sampling: list[int], sampled: list[list[int]]
    ) -> tuple[dict[str, list[int]], float]:
        """Drafts for every request that sampled, from its tokens (n-gram lookup), as
        many of them as its recent acceptance makes worth verifying."""
        if self.proposer is None or not sampling:
            return {}, 0.0
        t0 = time.perf_counter()
        rows = inputs.sample_rows
        lengths = self.batch.num_tokens[rows]
        # Only the known part of each row: a full row is max_model_len wide.
        tokens = self.batch.token_ids[rows, : int(lengths.max())]
        proposals = self.proposer.propose(tokens, lengths)
        limiter = self.limiter
        if limiter is not None:
            verified = inputs.drafts
            for j, (row, i) in enumerate(zip(rows.tolist(), sampling)):
                limiter.observe(row, verified[j] if verified is not None else (), sampled[i])
                proposals[j] = limiter.limit(row, proposals[j])
        params = inputs.sample_params
        for j, p in enumerate(params):
            # Logits processing and logprobs are per sampled position; a request with them
            # gets no drafts, so that its one row is exact (see _verify).
            if p.processes_logits or p.logprobs is not None:
                proposals[j] = []
        drafts = {inputs.req_ids[i]: d for i, d in zip(sampling, proposals)}
        return drafts, time.perf_counter() - t0

    def drop(self, req_id: str) -> None:
        """Forget a finished request now. EngineCore skips the runner on a step with
        nothing scheduled, so a finish announced only in such a step's SchedulerOutput
        would never reach execute(); the engine tells the runner directly."""
        self.batch.remove(req_id)

    def flush_timings(self) -> list[Timing]:
        """Timings not yet reported (CUDA reads them one step late)."""
        return self.timer.flush()

    @contextlib.contextmanager
    def _profile(self, enabled: bool) -> Iterator[Any]:
        if not enabled:
            yield None
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            yield prof


def resolve_device(options: RunnerOptions) -> torch.device:
    if options.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if options.device == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            f"--device cuda: no CUDA device is available (this torch build: {torch.__version__})"
        )
    return torch.device(options.device)


def resolve_dtype(options: RunnerOptions, device: torch.device) -> torch.dtype:
    if options.dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        options.dtype
    ]


def _cpu_attention(
    options: RunnerOptions, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> AttentionBackend:
    """The C kernel where it applies; asked for by name where it does not, an error."""
    from engine.model.attention import native
    from engine.model.attention.cpu_backend import CpuPagedAttention
    from engine.model.attention.torch_backend import TorchAttention

    why = None
    if device.type != "cpu":
        why = f"it runs on the CPU, not {device.type}"
    elif dtype != torch.float32:
        why = f"it computes in float32, not {str(dtype).removeprefix('torch.')}"
    elif native.kernel() is None:
        why = f"its C kernel is not available here ({native.kernel_status()})"
    if why is None:
        return CpuPagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if options.attention_backend == "cpu":
        raise ModelError(f"attention_backend=cpu: {why}; use attention_backend=torch")
    return TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)


def make_attention(
    options: RunnerOptions, spec: ModelSpec, device: torch.device, dtype: torch.dtype
) -> AttentionBackend:
    name = options.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        return _cpu_attention(options, spec, device, dtype)
    if name == "triton":
        if device.type != "cuda":
            raise ModelError(
                "the Triton attention backend needs a CUDA device; use the torch backend on CPU"
            )
        from engine.model.attention.triton_backend import TritonAttention

        return TritonAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)
    from engine.model.attention.torch_backend import TorchAttention

    return TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim)


def check_config(config: EngineConfig, spec: ModelSpec) -> None:
    if config.max_model_len > spec.max_position:
        raise ModelError(
            f"max_model_len={config.max_model_len} exceeds the model's context "
            f"length ({spec.max_position})"
        )
    if config.num_speculative_tokens and config.speculative_config is None:
        raise ModelError(
            "num_speculative_tokens alone is the simulator's drafter; on the model, give "
            '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 4}\''
        )


def activation_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype) -> int:
    """A generous estimate of a forward pass's peak beyond the weights: the widest
    activations of a full token budget, twice over, plus fp32 logits and sampling buffers."""
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = config.max_num_batched_tokens
    width = spec.hidden_size * 4 + spec.q_size + 2 * spec.kv_size + 3 * spec.intermediate_size
    return 2 * tokens * width * elem + 4 * config.max_num_seqs * spec.vocab_size * 4


def num_kv_blocks(
    options: RunnerOptions,
    spec: ModelSpec,
    config: EngineConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    if options.num_gpu_blocks_override is not None:
        return options.num_gpu_blocks_override
    if device.type == "cuda":
        memory = cuda_kv_memory(
            device, options.gpu_memory_utilization, activation_bytes(spec, config, dtype)
        )
    else:
        memory = options.kv_cache_memory or DEFAULT_CPU_KV_MEMORY
    return blocks_for_memory(memory, spec, config.block_size, dtype)


def build_runner(
    loaded: LoadedModel, config: EngineConfig, options: RunnerOptions
) -> tuple[ModelRunner, EngineConfig]:
    """Put the model on its device, size and allocate the KV cache, and return the runner
    with the engine config whose num_blocks matches the cache."""
    check_config(config, loaded.spec)
    if options.num_threads is not None:
        torch.set_num_threads(options.num_threads)
    device = resolve_device(options)
    dtype = resolve_dtype(options, device)
    threads = None
    if device.type == "cpu":
        keep_freed_memory()
        if options.num_threads is None:
            threads = shared_thread_tuner()
    timer = StepTimer(device)
    attention = TimedAttention(make_attention(options, loaded.spec, device, dtype), timer)
    model = LlamaModel(loaded.spec, loaded.weights, attention, device, dtype)
    num_blocks = num_kv_blocks(options, loaded.spec, config, dtype, device)
    try:
        config = config.replace(num_blocks=num_blocks)
    except ValueError as e:
        raise ModelError(f"KV cache: {e}") from None
    try:
        kv = KVCache(loaded.spec, num_blocks, config.block_size, dtype, device)
    except (RuntimeError, MemoryError) as e:  # torch's out-of-memory is a RuntimeError
        raise ModelError(
            f"KV cache: cannot allocate {num_blocks} blocks: {str(e).splitlines()[0]}; "
            "lower kv_cache_memory or num_gpu_blocks_override"
        ) from None
    return ModelRunner(model, kv, config, options, timer, threads), config


_TUNER: ThreadTuner | None = None


def shared_thread_tuner() -> ThreadTuner:
    """One tuner per process: torch's thread count is process-wide, and a second engine
    must not take the first one's choice for the machine's default."""
    global _TUNER
    if _TUNER is None:
        _TUNER = ThreadTuner()
    return _TUNER
