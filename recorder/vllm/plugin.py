"""vLLM's `vllm.general_plugins` entry point: refuse a recording that cannot work before
vLLM loads the model.

vLLM constructs the scheduler (and so `RecordingScheduler`'s own checks) only after the
executor has loaded the model and profiled the KV cache: a mistyped SCHEDTOP_TRACE_DIR
used to cost a full model load before the engine died. vLLM calls general plugins in
every process it starts, the first time while `vllm serve` builds its argument parser,
before anything is loaded; this one checks what needs no vLLM config (the vLLM version,
the trace directory, the SCHEDTOP_* numbers, sizes and live port) and exits with one line
on a problem.

It acts only when the command line names `recorder.vllm.RecordingScheduler`: the plugin
is installed with schedtop, so it runs for every vLLM in that venv, recording or not.
(`LLM(scheduler_cls=...)` from Python is not on the command line; the scheduler's own
checks still refuse those at construction.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from recorder.errors import RecordingError
from recorder.paths import make_trace_dir, trace_dir
from recorder.vllm.checks import check_version, env_number
from recorder.vllm.live import settings as live_settings

SCHEDULER_CLS = "recorder.vllm.RecordingScheduler"
NUMBERS = (
    "SCHEDTOP_FLUSH_INTERVAL_S",
    "SCHEDTOP_SNAPSHOT_INTERVAL",
    "SCHEDTOP_SNAPSHOT_WORK",
    "SCHEDTOP_SNAPSHOT_BUDGET",
)


def records(argv: Sequence[str]) -> bool:
    """Whether this command line asks vLLM to record (`--scheduler-cls ...RecordingScheduler`)."""
    return any(SCHEDULER_CLS in arg for arg in argv)


def early_problems(version: str) -> list[str]:
    """What would make the recording fail at the scheduler's construction, found now."""
    problems = []
    try:
        check_version(version)
    except RecordingError as e:
        problems.append(str(e))
    for name in NUMBERS:
        try:
            env_number(name, 0.0)
        except RecordingError as e:
            problems.append(str(e))
    try:  # rotation and the live port (recorder.vllm.live): sizes, port, key
        live_settings()
    except RecordingError as e:
        problems.append(str(e))
    exact = os.environ.get("SCHEDTOP_TRACE_FILE")
    if exact:
        parent = os.path.dirname(os.path.abspath(exact))
        if not os.path.isdir(parent):
            problems.append(f"SCHEDTOP_TRACE_FILE={exact}: its directory does not exist")
        elif not os.access(parent, os.W_OK):
            problems.append(f"SCHEDTOP_TRACE_FILE={exact}: its directory is not writable")
        return problems
    directory = trace_dir()
    try:
        make_trace_dir(directory)
    except RecordingError as e:
        problems.append(str(e))
        return problems
    if not os.access(directory, os.W_OK | os.X_OK):
        problems.append(f"{directory}: the trace directory is not writable")
    return problems


def check_early() -> None:
    """The entry point vLLM calls; exits with one line per problem when recording is asked."""
    if not records(sys.argv):
        return
    import vllm

    problems = early_problems(vllm.__version__)
    if problems:
        raise SystemExit("\n".join(f"schedtop: {p} (before loading the model)" for p in problems))
