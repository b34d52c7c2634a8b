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
class EngineResimResult:
    """What a re-simulation with an engine's own scheduler (vLLM's, SGLang's) did."""

    trace: Path  # the trace that scheduler recorded
    num_steps: int  # steps it ran
    divergence_step: int | None  # first step deciding differently from the original
    fields: tuple[str, ...]  # what differs there

    @property
    def reproduced(self) -> bool:
        return self.divergence_step is None


def find_python(env_var: str, package: str, venv: str) -> str:
    """The interpreter that has `package` (an engine schedtop does not depend on):
    $env_var, else this one if it can import it, else `venv/bin/python` next to the
    project; ResimError when there is none."""
    configured = os.environ.get(env_var)
    if configured:
        if not Path(configured).exists():
            raise ResimError(f"{env_var}={configured}: no such interpreter")
        return configured
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    local = ROOT / venv / "bin" / "python"
    if local.exists():
        return str(local)
    raise ResimError(
        f"no {package} to run: install {package} into a venv and set {env_var} to its "
        f"python ({package} is not a schedtop dependency)"
    )


def vllm_python() -> str:
    """The interpreter to run vLLM with; ResimError when there is none."""
    return find_python(PYTHON_ENV, "vllm", ".venv-vllm")


def drive(
    python: str,
    driver: str,
    who: str,
    path: str | Path,
    out: str | Path | None,
    settings: list[str],
    overwrite: bool,
    env: dict[str, str] | None = None,
) -> EngineResimResult:
    """Run an engine's driver module (`python -m driver TRACE OUT [KEY=VALUE ...]`) in
    the engine's interpreter, which records OUT; compare OUT with the trace. `out` must
    not exist unless `overwrite`; by default it is a fresh name in the trace directory
    (`...-resim-WHO-PID.trace`), never next to `path`: a directory of incidents that
    `pytest --schedtop-traces` globs must not gain a re-simulation as an incident."""
    from recorder.paths import new_trace_path

    path = Path(path)
    if not path.exists():
        raise ResimError(f"{path}: no such file")
    if out is None:
        out = new_trace_path(f"resim-{who.lower()}")
        out.parent.mkdir(parents=True, exist_ok=True)
    out = Path(out)
    if out.exists() and not overwrite:
        raise ResimError(f"{out}: exists; refusing to overwrite it")
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [python, "-m", driver, str(path), str(out), *settings],
        capture_output=True,
        text=True,
        env=full_env,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise ResimError(f"{who}'s side failed (exit {proc.returncode}):\n{tail}")
    try:
        steps = int(json.loads(proc.stdout.strip().splitlines()[-1])["steps"])
    except (ValueError, KeyError, IndexError):
        raise ResimError(f"{who}'s side said: {proc.stdout[-500:]!r}") from None
    d = diff_traces(path, out)
    return EngineResimResult(out, steps, d.first_step, d.fields)


def resimulate_with_vllm(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
) -> EngineResimResult:
    """Drive vLLM's scheduler with the trace's inputs; compare with the trace (`drive`
    says where the new trace goes)."""
    settings = [f"{k}={v}" for k, v in (overrides or {}).items()]
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}
    return drive(vllm_python(), "replays.vllm_driver", "vLLM", path, out, settings, overwrite, env)
