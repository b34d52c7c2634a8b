"""What both re-simulation runners share: the result types, the checker that compares
each re-simulated step with the trace's, and the recorder it feeds."""

from __future__ import annotations

import dataclasses
import struct
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import UserError
from engine.records import MID_STEP_ABORT
from recorder.errors import TraceError
from recorder.recorder import Recorder, RecorderOptions
from recorder.schema import Header, Step
from recorder.writer import NullWriter, TraceWriter
from replays.diff import EntryForms, differing_fields

_DRIVER_KEYS = ("max_steps",)


class ResimError(UserError, ValueError):
    """A trace that cannot be re-simulated, or overrides that do not make a valid config."""


@dataclass(frozen=True)
class Divergence:
    """The first step where the re-simulation decided differently from the trace."""

    step: int  # the step
    fields: tuple[str, ...]  # which parts of the step record differ
    recorded: Step | None  # the trace's record (None: the trace had no such step)
    resimulated: Step | None  # the re-simulation's (None: it ended before this step)


@dataclass
class ResimResult:
    """What a re-simulation did."""

    config: EngineConfig  # the config it ran with
    changed: dict[str, Any]  # the overrides applied to the recorded config
    num_recorded_steps: int  # steps in the trace
    num_steps: int  # steps the re-simulation ran
    divergence: Divergence | None  # the first differing step; None: identical decisions
    trace: Path | None  # where the new trace went, if anywhere
    mode: str  # "faithful" or "scripted"

    @property
    def reproduced(self) -> bool:
        return self.divergence is None

    def format(self) -> str:
        """What `schedtop resim` prints of it: steps, the config, the first difference."""
        changed = ", ".join(f"{k}={v}" for k, v in self.changed.items())
        lines = [
            f"re-simulated {self.num_steps} steps ({self.num_recorded_steps} recorded)"
            + (f" with {changed}" if changed else " with the recorded config")
        ]
        if self.divergence is None:
            lines.append(
                "every decision reproduced" if not changed else "the change alters no decision"
            )
        else:
            d = self.divergence
            lines.append(f"first difference at step {d.step}: {', '.join(d.fields)}")
        return "\n".join(lines)


@contextmanager
def inputs_checked(path: str | Path) -> Iterator[None]:
    """A trace whose inputs drive the scheduler (or the writer) into an error, a crafted
    one, is a TraceError naming it, whatever was raised: one line, exit status 2."""
    try:
        yield
    except ResimError:  # a ValueError, but already says what is wrong
        raise
    except _ENGINE_ERRORS as e:
        err = TraceError(
            f"its records cannot be re-simulated ({type(e).__name__}: {e or 'no detail'}); "
            "it was not written by this engine, or was altered"
        )
        err.path = str(path)
        raise err from e


# What the engine raises when fed inputs it never produces. A TraceError, ResimError or
# OSError is already the right error and passes through.
_ENGINE_ERRORS = (
    ValueError,
    IndexError,
    KeyError,
    TypeError,
    AssertionError,
    ZeroDivisionError,
    OverflowError,
    struct.error,
    RecursionError,
)


def config_for(recorded: dict[str, Any], overrides: dict[str, Any]) -> EngineConfig:
    try:
        base = EngineConfig.from_dict(recorded, ignore=_DRIVER_KEYS)
    except (ValueError, TypeError) as e:
        raise ResimError(f"the trace's config is not valid here: {e}") from None
    try:
        return base.replace(**overrides)
    except (ValueError, TypeError) as e:
        raise ResimError(f"--set: {e}") from None


# -- checking steps as they come ----------------------------------------------------------------


class Checker:
    """Compares each re-simulated step record with the trace's (timings masked). The
    trace's records come from `source`, or are queued with `expect` just before the step
    that should reproduce them."""

    def __init__(self, source: Iterator[Step] | None = None) -> None:
        self.source = source
        self.pending: deque[Step] = deque()
        self.steps = 0
        self.divergence: Divergence | None = None
        self.forms = EntryForms()  # a trace's decode_skips against their spelled-out form

    def expect(self, rec: Step) -> None:
        self.pending.append(rec)

    def __call__(self, step: Step) -> None:
        self.steps += 1
        if self.divergence is not None:
            return
        if self.pending:
            rec: Step | None = self.pending.popleft()
        else:
            rec = next(self.source, None) if self.source is not None else None
        if rec is None:
            self.divergence = Divergence(step.step, ("steps",), None, step)
            return
        fields = self.forms.differing(rec, step, differing_fields(rec, step))
        if fields:
            self.divergence = Divergence(step.step, fields, rec, step)


def recorder_for(
    engine: EngineCore,
    header: Header,
    out: str | Path | None,
    checker: Checker | None,
    clock: Callable[[], int] | None = None,
) -> Recorder:
    """A recorder of a re-simulation of the trace with `header` into `out` (None: no file),
    with the trace's settings; `clock` (default the monotonic one) is the steps' time."""
    sink = TraceWriter(out, live=False) if out is not None else NullWriter()
    options = RecorderOptions(
        redact_prompts=header.redacted,
        snapshot_interval=header.snapshot_interval,
        # The trace's bounds; with no work bound (recorder.vllm places snapshots by cost,
        # up to 4096 steps apart), the engine's default one, so the output seeks well.
        snapshot_work=header.snapshot_work or None,
        model=header.model,
        on_step_record=checker,
        # A record the writer cannot encode came from a crafted trace's inputs: raise it
        # here, as one line naming the trace, not as a logged traceback.
        strict=True,
    )
    if clock is not None:
        options = dataclasses.replace(options, clock=clock)
    return Recorder(engine, sink, options)


def check_sampled_ids(rec: Step, redacted: bool) -> None:
    """A trace that is not redacted records every sampled token id; a nil there would
    reach the engine, and the re-simulated trace's writer, as a stand-in (-1)."""
    if not redacted and (
        rec.sampled_tokens is None or any(s.token_ids is None for s in rec.other_samples)
    ):
        raise ValueError(f"step {rec.step}: sampled token ids are nil in a trace not redacted")


def recorded_proposals(config: EngineConfig) -> bool:
    """Whether the trace's drafter proposes a varying number of drafts, recorded per
    request (n-gram); the simulated drafter always proposes k."""
    return config.speculative_config is not None


def is_mid_step_abort(message: str) -> bool:
    """Whether an abort's finish says it came between schedule() and update (vLLM's
    engine core applies aborts there too); re-simulation aborts it there."""
    return message.startswith(MID_STEP_ABORT)
