"""`schedtop resim TRACE --engine sglang`: re-simulate an SGLang trace with SGLang's own
scheduler (replays.sglang_driver, in an interpreter that has SGLang 0.5.23), compared step
by step with the recording, as `--engine vllm` does for vLLM (replays.vllm_resim runs
both). "Does SGLang still decide the same on this incident after an upgrade, or with my
patch?" is this command.

Which interpreter: $SCHEDTOP_SGLANG_PYTHON, else this one if it can import sglang, else
`.venv-sglang/bin/python` next to the project. SGLang is never a dependency of schedtop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from replays.resim import ResimError
from replays.vllm_resim import EngineResimResult, drive, find_python

PYTHON_ENV = "SCHEDTOP_SGLANG_PYTHON"


def sglang_python() -> str:
    """The interpreter to run SGLang with; ResimError when there is none."""
    return find_python(PYTHON_ENV, "sglang", ".venv-sglang")


def resimulate_with_sglang(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
) -> EngineResimResult:
    """Drive SGLang's scheduler with an SGLang trace's inputs; compare with the trace."""
    from recorder.multi import open_trace

    if Path(path).exists():  # else drive() says so
        with open_trace(path) as reader:
            engine = reader.header.engine
        if not engine.startswith("SGLang"):
            raise ResimError(
                f"{path}: a trace of {engine}: --engine sglang re-simulates SGLang's traces"
            )
    if overrides:
        # SGLang's knobs are not schedtop's config keys; a what-if with them is to come
        raise ResimError("--engine sglang re-simulates with the recorded config only (no --set)")
    env = {"SGLANG_PLUGINS": "", "SCHEDTOP_STRICT": os.environ.get("SCHEDTOP_STRICT", "1")}
    return drive(sglang_python(), "replays.sglang_driver", "SGLang", path, out, [], overwrite, env)
