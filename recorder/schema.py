"""The trace's records: what a trace holds, independent of how it is encoded.

The records of a step (arrivals, scheduled entries, admissions, preemptions, finishes, KV
events, the step itself, request states and snapshots) and their enums are defined once,
in `engine.records`, which the engine fills in; this module re-exports them and adds the
records only a trace has (header, footer, end). `engine.records` is pure Python, so a
reader needs neither torch nor the model stack. Requests are named by their *ref* (see
engine.records); enum-valued fields hold plain ints when decoded, so that a reader can
carry a value it does not know yet.

`docs/trace-format.md` is the specification; `recorder.codec` is its implementation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.records import (
    KIND_LABELS,
    NO_KV_EVENTS,
    REASON_LABELS,
    STATUS_LABELS,
    Admission,
    Arrival,
    Finish,
    Kernel,
    Kind,
    KVEvent,
    KVEvents,
    KVKind,
    Preemption,
    QueueStop,
    Reason,
    RequestState,
    Sample,
    SamplingParams,
    Scheduled,
    Shortfall,
    Snapshot,
    SpecAccepted,
    Status,
    Step,
    Timing,
    label,
    percentile,
)

Sampling = SamplingParams  # the name the trace format gives a request's sampling parameters
RequestSnap = RequestState  # the name the trace format gives a request in a snapshot

__all__ = [
    "KIND_LABELS",
    "REASON_LABELS",
    "STATUS_LABELS",
    "label",
    "percentile",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "NO_KV_EVENTS",
    "Admission",
    "Arrival",
    "End",
    "Finish",
    "Footer",
    "Header",
    "Kernel",
    "Kind",
    "KVEvent",
    "KVEvents",
    "KVKind",
    "Preemption",
    "QueueStop",
    "Reason",
    "Record",
    "RecordType",
    "RequestSnap",
    "RequestState",
    "Sample",
    "Sampling",
    "SamplingParams",
    "Scalar",
    "Scheduled",
    "Shortfall",
    "Snapshot",
    "SpecAccepted",
    "Status",
    "Step",
    "Timing",
]

FORMAT_MAJOR = 1  # a reader refuses traces with a newer major version
FORMAT_MINOR = 0  # minor versions only add fields and record types, which readers skip

Scalar = str | int | float | bool | None


class RecordType(enum.IntEnum):
    """The type tag in each record's frame."""

    HEADER = 1
    STEP = 2
    SNAPSHOT = 3
    FOOTER = 4
    END = 5


# -- header ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Header:
    """The first record: what wrote the trace and how the engine was configured."""

    engine: str  # what wrote the trace, e.g. "schedtop 0.1.0 (SimRunner)"
    model: str  # model description; "" when there is none (simulated runs)
    config: dict[str, Scalar]  # the engine config, knob name -> value
    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks in the pool, the null block 0 included
    policy: str  # "fcfs" or "priority": how the reducer orders the waiting queue
    start_time_ns: int  # wall clock (Unix ns) when recording started; masked in comparisons
    host: str  # the machine's name
    redacted: bool  # token ids replaced by lengths and block hashes
    first_step: int = 0  # the step of the first step record (> 0: attached mid-run)
    snapshot_interval: int = 256  # a snapshot follows step s when (s + 1) % interval == 0


# -- footer ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footer:
    """Written at clean close: where every step and snapshot is, and totals."""

    first_step: int  # step of step_offsets[0]
    step_offsets: tuple[int, ...]  # byte offset of every step record; () if too many
    snapshot_steps: tuple[int, ...]  # the step of each snapshot
    snapshot_offsets: tuple[int, ...]  # byte offset of each snapshot record
    num_steps: int  # step records written
    num_arrivals: int  # requests that arrived
    num_finishes: int  # requests that finished
    num_preemptions: int  # preemptions
    end_time_ns: int  # monotonic ns since recording started, at close (timing)


@dataclass(frozen=True, slots=True)
class End:
    """The last record: where the footer starts. Fixed size, so it is found from the end."""

    footer_offset: int  # byte offset of the footer record


Record = Header | Step | Snapshot | Footer | End
