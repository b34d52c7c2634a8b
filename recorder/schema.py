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

from engine.limits import MAX_NUM_BLOCKS
from engine.records import (
    KIND_LABELS,
    NO_KV_EVENTS,
    NOT_REACHED,
    REASON_KNOBS,
    REASON_LABELS,
    STATUS_LABELS,
    WAIT_LABELS,
    Admission,
    Arrival,
    Client,
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
    SlotWrite,
    Snapshot,
    SpecAccepted,
    SpecProposed,
    Status,
    Step,
    Timing,
    label,
    percentile,
    printable,
)

MAX_BLOCKS = MAX_NUM_BLOCKS  # the writers' limit is the readers': whatever a run records, reads

__all__ = [
    "printable",
    "MAX_BLOCKS",
    "KIND_LABELS",
    "REASON_KNOBS",
    "REASON_LABELS",
    "STATUS_LABELS",
    "WAIT_LABELS",
    "NOT_REACHED",
    "label",
    "percentile",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "NO_KV_EVENTS",
    "Admission",
    "SlotWrite",
    "Arrival",
    "Client",
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
    "RequestState",
    "Sample",
    "SamplingParams",
    "Scalar",
    "Scheduled",
    "Shortfall",
    "Snapshot",
    "SpecAccepted",
    "SpecProposed",
    "Status",
    "Step",
    "Timing",
]

FORMAT_MAJOR = 1  # a reader refuses traces with a newer major version
FORMAT_MINOR = 9  # minor versions only add fields and record types, which readers skip
# 1.1: SpecProposed entries and Timing.propose_ns (speculative decoding); CLIENT records
#      (schedtop serve)
# 1.2: Header.snapshot_work (snapshots placed by replay work as well as by step count)
# 1.3: block hashes of 8 bytes (HASH_BYTES; readers cut longer ones from older traces)
# 1.4: Step.work_ns (the engine's work in a step, apart from the idle wait before it);
#      Header.arrival_origin_ns (arrival times on the trace's clock)
# 1.5: SGLang's token pool: Header.kv_pool, Step.free_slots/cached_slots, Preemption.cause,
#      Reason.RETRACTED
# 1.6: Client.parent_id (one CLIENT record per choice of a request with n > 1)
# 1.7: Step.decode_skips (implicit decodes that pass over running requests)
# 1.8: Step.evicted_slots (SGLang's radix-cache evictions, a count of slots a step)
# 1.9: Header.slot_map, Step.slot_allocs/slot_writes/slots_freed_first/slots_freed/
#      evictable_slots, Snapshot.slot_rows/free_slot_runs/evictable_slots (SGLang's token
#      pool slot by slot)

Scalar = str | int | float | bool | None


class RecordType(enum.IntEnum):
    """The type tag in each record's frame."""

    HEADER = 1
    STEP = 2
    SNAPSHOT = 3
    FOOTER = 4
    END = 5
    CLIENT = 6  # since 1.1: an HTTP request as a server saw it (schedtop serve)


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
    snapshot_interval: int = 256  # steps from one snapshot (or the start) to the next, at most
    snapshot_work: int = 0  # replay work from one snapshot to the next, at most (0: no bound)
    arrival_origin_ns: int | None = None  # the arrival clock at time 0, ns (None: unknown)
    # (1.5) "blocks": the block map is the engine's; "tokens": a token pool (SGLang) whose
    # slots the trace does not track one by one (no KV events; Step.free_slots instead)
    kv_pool: str = "blocks"
    # (1.9) a token pool whose steps track every slot (Step.slot_allocs ...): the TUI
    # draws it slot by slot
    slot_map: bool = False

    def __post_init__(self) -> None:
        # a crafted header must fail as a TraceError here, not as a ZeroDivisionError later
        if self.snapshot_interval < 1:
            raise ValueError(f"snapshot_interval={self.snapshot_interval}: must be >= 1")
        if self.snapshot_work < 0:
            raise ValueError(f"snapshot_work={self.snapshot_work}: must be >= 0")
        if not 1 <= self.block_size <= 4096:
            raise ValueError(f"block_size={self.block_size}: must be in [1, 4096]")


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
    # Why recording stopped before the engine did ("": it recorded to the end): a request
    # or an event the recorder cannot record (recorder.vllm), written at that close.
    stopped: str = ""


@dataclass(frozen=True, slots=True)
class End:
    """The last record: where the footer starts. Fixed size, so it is found from the end."""

    footer_offset: int  # byte offset of the footer record


Record = Header | Step | Snapshot | Footer | End | Client
