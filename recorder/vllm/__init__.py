"""Record a real vLLM's scheduler into a schedtop trace.

    SCHEDTOP_TRACE_DIR=/var/traces vllm serve MODEL \\
        --scheduler-cls recorder.vllm.RecordingScheduler

`RecordingScheduler` is vLLM's own scheduler (the async or the sync one, whichever vLLM
would have chosen) with taps on the calls the engine core makes. It decides nothing: it
watches each step and writes schedtop's trace format (header, steps, snapshots, footer)
through the same converter and writer as schedtop's engine, so `replay`, `stats`, `find`,
`export`, `resim` and `diff` work on the file unchanged. vLLM's engine thread only builds
the records: a thread of the recorder's own encodes and appends them (and computes the
hashes of blocks that filled while decoding), off the scheduler's serial path.

What the taps see, per step: arrivals (with vLLM's request ids, which start with the
client's id), the scheduled requests in order, admissions with prefix hits, preemptions
in the order they happened with the request that needed the room, why requests were cut
short or left waiting (the reasons schedtop's scheduler gives, derived from the same
numbers), every KV block movement with block ids (from the KV cache manager and block
pool), samples, finishes, aborts, free-block counts and the queue orders.

Block hashes in the trace are schedtop's (the same content gives the same hash in both),
so that prefix hits re-simulate. vLLM is imported lazily and is never a dependency.

Environment: SCHEDTOP_TRACE_DIR (where traces go), SCHEDTOP_REDACT_PROMPTS=1 (hashes and
lengths instead of token ids), SCHEDTOP_FLUSH_INTERVAL_S (default 1.0),
SCHEDTOP_SNAPSHOT_INTERVAL (at most this many steps apart, default 4096) and
SCHEDTOP_SNAPSHOT_BUDGET (snapshots placed by their cost, at most this share of the CPU
time of vLLM's schedule + update, default 0.0025). One file per data-parallel rank.
SCHEDTOP_TRACE_MAX_BYTES and SCHEDTOP_LIVE_PORT (recorder.vllm.live) keep the recording
as `schedtop serve` keeps its own: rotating segments, incidents, a live stream. Set-ups whose
decisions schedtop's scheduler does not model are refused at start-up; requests that use
such features stop the recording with a warning (the file keeps every step before).

Modules: `checks` (what is refused, vLLM's config under schedtop's names), `kv` (the KV
cache manager and block pool taps), `lazyhash` (block hashes computed on first use),
`tap` (the decisions and the step records), `scheduler` (the class vLLM is given),
`live` (segments, incidents and the live port), `plugin` (refusals before the model loads).
"""

from recorder.vllm.checks import (
    SUPPORTED_VERSIONS,
    UnsupportedVllm,
    check_version,
    engine_config,
    request_problem,
    setup_problems,
)
from recorder.vllm.scheduler import RecordingMixin, RecordingScheduler, compose
from recorder.vllm.tap import Tap

__all__ = [
    "SUPPORTED_VERSIONS",
    "RecordingMixin",
    "RecordingScheduler",
    "Tap",
    "UnsupportedVllm",
    "check_version",
    "compose",
    "engine_config",
    "request_problem",
    "setup_problems",
]
