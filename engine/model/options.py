"""Runner options: how and where the model runs (the scheduler's knobs are EngineConfig).
Plain Python, so that the command line can build them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.limits import check_range

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


@dataclass(frozen=True)
class RunnerOptions:
    """Execution options, with vLLM's names where vLLM has one."""

    device: str = "auto"  # "auto": CUDA if available, else CPU
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"  # "auto": Triton on CUDA, the C kernel ("cpu") on CPU
    kv_cache_memory: int | None = None  # KV bytes on CPU (None: 1 GiB)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory for weights + KV
    num_gpu_blocks_override: int | None = None  # KV blocks, ignoring the memory budget
    profile_every: int = 0  # every Nth step carries a torch.profiler breakdown (0 = off)
    seed: int = 0  # the generator of unseeded sampling requests
    num_threads: int | None = None  # torch CPU threads (None: measured, 1 or all cores)
    adaptive_drafts: bool | None = None  # only the drafts worth verifying (None: on CPU)

    def __post_init__(self) -> None:
        for name in _INTS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}={value!r}: expected int")
            check_range(name, value)
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(
            self.gpu_memory_utilization, (int, float)
        ):
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r}: expected float"
            )
        if self.adaptive_drafts is not None and not isinstance(self.adaptive_drafts, bool):
            raise ValueError(f"adaptive_drafts={self.adaptive_drafts!r}: expected true or false")
        _one_of("device", self.device, DEVICES)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory}: must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override={self.num_gpu_blocks_override}: must "
                "be >= 2 (block 0 is the null block)"
            )
        if self.profile_every < 0:
            raise ValueError(f"profile_every={self.profile_every}: must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}: must be >= 1")


_INTS = ("kv_cache_memory", "num_gpu_blocks_override", "profile_every", "seed", "num_threads")
_OPTIONAL = {"kv_cache_memory", "num_gpu_blocks_override", "num_threads"}


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
