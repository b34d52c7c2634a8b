"""Record SGLang's scheduler into a schedtop trace (issue 29).

    pip install schedtop              # into SGLang's environment, next to sglang==0.5.23
    SGLANG_PLUGINS=schedtop SCHEDTOP_TRACE_DIR=/var/lib/schedtop \\
        python -m sglang.launch_server --model-path MODEL

SGLang has no `--scheduler-cls`, but an official plugin system: entry points in the group
`sglang.srt.plugins`, loaded at the start of each of its processes and selected by
`SGLANG_PLUGINS`. `register` (the entry point `schedtop`) wraps, with SGLang's own
`HookRegistry`, the scheduler methods that decide and report a step: the batch
(`get_next_batch_to_run`), the admission attempts (`PrefillAdder.add_one_req`), the
retractions (`ScheduleBatch.retract_decode`), the aborts of waiting requests and the
results (`process_batch_result`). SGLang decides exactly as it would have; the hooks
watch (`recorder.sglang.tap`). SGLang is imported lazily and is never a dependency.

docs/sglang.md says what is recorded, and the limits.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

SUPPORTED_VERSIONS = ("0.5.23",)

log = logging.getLogger("schedtop.recorder.sglang")


class UnsupportedSglang(RuntimeError):
    """This SGLang cannot be recorded (its version, or a set-up the recorder refuses)."""


def check_version(version: str) -> None:
    # The fields the hooks read moved in 0.5.20 and 0.5.23 (prefix_indices became
    # prefix_len/extend_end): another version would be recorded wrongly, not refused later.
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedSglang(
            f"schedtop records SGLang {', '.join(SUPPORTED_VERSIONS)}, not {version}: "
            "install a matching schedtop or unset SGLANG_PLUGINS=schedtop"
        )


def stub_vllm_custom_ops() -> None:
    """Without CUDA, SGLang's rotary embedding imports `vllm._custom_ops` (its CPU path
    never calls it). Only where vLLM is absent: a real vLLM is never shadowed."""
    if "vllm._custom_ops" in sys.modules or importlib.util.find_spec("vllm") is not None:
        return
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []
    ops = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args: object, **kwargs: object) -> None:
        raise RuntimeError("vllm._custom_ops is schedtop's stub: SGLang's CUDA path needs vLLM")

    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", vllm)
    sys.modules["vllm._custom_ops"] = ops


def register() -> None:
    """The entry point SGLang calls (SGLANG_PLUGINS=schedtop) in each of its processes:
    the hooks act only in the scheduler process, on its first step."""
    from importlib.metadata import version

    check_version(version("sglang"))
    try:
        import torch

        if not torch.cuda.is_available():
            stub_vllm_custom_ops()
    except ImportError:
        pass
    from recorder.sglang.hooks import install

    install()


__all__ = [
    "SUPPORTED_VERSIONS",
    "UnsupportedSglang",
    "check_version",
    "register",
    "stub_vllm_custom_ops",
]
