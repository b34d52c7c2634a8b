"""`schedtop resim TRACE --engine vllm`: re-simulate with the installed vLLM's scheduler.

The oracle direction: a trace (schedtop's own, or one recorded inside vLLM) is fed to
vLLM's scheduler by replays.vllm_driver in an interpreter that has vLLM, recorded with
recorder.vllm, and compared step by step with the original. "Does vLLM 0.34 still decide
the same on last month's incidents?" is this command after an upgrade.

Which interpreter: $SCHEDTOP_VLLM_PYTHON, else this one if it can import vllm, else
`.venv-vllm/bin/python` next to the project. vLLM is never a dependency of schedtop.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replays.diff import diff_traces
from replays.resim import ResimError

PYTHON_ENV = "SCHEDTOP_VLLM_PYTHON"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class VllmResimResult:
    """What a re-simulation with vLLM's scheduler did."""

    trace: Path  # the trace vLLM's scheduler recorded
    num_steps: int  # steps it ran
    divergence_step: int | None  # first step deciding differently from the original
    fields: tuple[str, ...]  # what differs there

    @property
    def reproduced(self) -> bool:
        return self.divergence_step is None


def vllm_python() -> str:
    """The interpreter to run vLLM with; ResimError when there is none."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        if not Path(configured).exists():
            raise ResimError(f"{PYTHON_ENV}={configured}: no such interpreter")
        return configured
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    local = ROOT / ".venv-vllm" / "bin" / "python"
    if local.exists():
        return str(local)
    raise ResimError(
        f"no vLLM to run: install vllm into a venv and set {PYTHON_ENV} to its python "
        "(vLLM is not a schedtop dependency)"
    )


def resimulate_with_vllm(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
) -> VllmResimResult:
    """Drive vLLM's scheduler with the trace's inputs; compare with the trace. `out`
    must not exist unless `overwrite`; by default it is a fresh name in the trace
    directory (`...-resim-vllm-PID.trace`), never next to `path`: a directory of incidents
    that `pytest --schedtop-traces` globs must not gain a re-simulation as an incident."""
    from recorder.paths import new_trace_path

    path = Path(path)
    if not path.exists():
        raise ResimError(f"{path}: no such file")
    if out is None:
        out = new_trace_path("resim-vllm")
        out.parent.mkdir(parents=True, exist_ok=True)
    out = Path(out)
    if out.exists() and not overwrite:
        raise ResimError(f"{out}: exists; refusing to overwrite it")
    settings = [f"{k}={v}" for k, v in (overrides or {}).items()]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    proc = subprocess.run(
        [vllm_python(), "-m", "replays.vllm_driver", str(path), str(out), *settings],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ResimError(f"vLLM's side failed (exit {proc.returncode}):\n{tail}")
    try:
        steps = int(json.loads(proc.stdout.strip().splitlines()[-1])["steps"])
    except (ValueError, KeyError, IndexError):
        raise ResimError(f"vLLM's side said: {proc.stdout[-500:]!r}") from None
    d = diff_traces(path, out)
    return VllmResimResult(out, steps, d.first_step, d.fields)
