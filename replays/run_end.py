"""When a re-simulated run is over: one predicate for every step driver (ours and
`--engine vllm`), so that they end a run where vLLM's engine core ended it.

With async scheduling vLLM's engine core keeps up to two batches in flight. When the last
request finishes, a batch scheduled before that (empty, or with nothing left to sample)
may still be queued. Whether it is drained depends on who steps the engine core:

- vLLM's own busy loop (the engine-core process of `vllm serve`, the default) keeps
  stepping while its scheduler has requests or its batch queue is not empty, so it drains
  the queue: one more schedule() that tells the workers about the finished requests, then
  an update without a schedule(), both recorded as empty steps;
- an in-process engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `LLM.generate`) steps
  only while its client has an unfinished request, so the run ends with the step whose
  update finished the last request, and the queued batch is left where it is (a later
  request would drain it).

A trace does not say which loop stepped it, but it shows it: the drain steps are in it or
not. So a re-simulation runs the recorded steps, then on while a request is unfinished,
and drains batches in flight only as far as the recording did. A run with no recording to
follow (a workload) drains them, as the busy loop does and as schedtop's engine does.

A recording that ended before its run did (the process was killed, so there is no
footer, or the recorder stopped on a request it cannot record, which the footer says)
ends the re-simulation at its last step too: its requests still running are not
finished, they were no longer recorded.
"""

from __future__ import annotations


def run_is_over(
    step: int,
    last_input_step: int,
    num_recorded: int | None,
    has_unfinished_requests: bool,
    batches_in_flight: bool,
    recording_ended_early: bool = False,
) -> bool:
    """Whether no step `step` (0-based) should run: every input is in (arrivals and aborts
    up to `last_input_step`), no request is unfinished, and either no batch is in flight
    or the recording (`num_recorded` steps; None: no recording) stopped before draining
    it. With `recording_ended_early`, also once the recorded steps are done."""
    if recording_ended_early and num_recorded is not None and step >= num_recorded:
        return True
    if step <= last_input_step or has_unfinished_requests:
        return False
    if not batches_in_flight:
        return True
    return num_recorded is not None and step >= num_recorded
