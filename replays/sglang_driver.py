"""The SGLang side of `schedtop resim --engine sglang`: runs in an interpreter that has
SGLang 0.5.23 ($SCHEDTOP_SGLANG_PYTHON).

    python -m replays.sglang_driver TRACE OUT

Builds SGLang's own Scheduler in this process, with the config the trace's header
recorded (a tiny Llama with random weights stands in for the model: the scheduler's
decisions do not depend on what the model computes), with schedtop's recording hooks
(recorder.sglang), and runs SGLang's own event loop on it. Only two things differ from a
server: the requests come from the trace instead of a socket (each arrival and abort
before the step it came before in the recording), and each request samples the tokens
the trace says it sampled (the radix cache holds outputs too). OUT is what the hooks
recorded; `schedtop resim` compares it with TRACE step by step.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.driver import RequestScript, step_limit
from recorder.reader import TraceReader
from recorder.schema import Status
from replays.scripts import collect_scripts

# The stand-in model: SGLang sizes nothing by it that the header does not fix.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


class DriverError(SystemExit):
    """What the driver cannot do, said in one line (exit status 2's message)."""


@dataclass
class Inputs:
    header_config: dict[str, Any]
    scripts: list[RequestScript]  # by ref, in arrival order
    num_steps: int
    abort_at: dict[int, int]  # ref -> the step before which SGLang received its abort


def read_inputs(path: str | Path) -> Inputs:
    from recorder.sglang.tap import ABORT_RECEIVED

    with TraceReader(path) as reader:
        header = reader.header
        if not header.engine.startswith("SGLang"):
            raise DriverError(f"{path}: a trace of {header.engine}, not of SGLang")
        if header.redacted:
            raise DriverError(f"{path}: a redacted trace has no token ids to send SGLang")
        if header.first_step != 0:
            raise DriverError(f"{path}: the trace starts mid-run (step {header.first_step})")
        scripts, steps = collect_scripts(reader)
    abort_at = {}
    for ref, s in enumerate(scripts):
        if s.status == Status.FINISHED_ABORTED:
            msg = s.abort_message
            at = int(msg[len(ABORT_RECEIVED) :]) if msg.startswith(ABORT_RECEIVED) else -1
            abort_at[ref] = at if at >= 0 else s.abort_step
    return Inputs(dict(header.config), scripts, steps, abort_at)


def model_dir(inputs: Inputs) -> str:
    """A config.json for the stand-in model: token ids and lengths the trace needs."""
    top = max(
        [max(s.arrival.prompt_token_ids or (0,)) for s in inputs.scripts]
        + [max(s.tokens or [0]) for s in inputs.scripts]
        + [511]
    )
    eos = next((s.arrival.eos_token_id for s in inputs.scripts), None)
    config = {
        **TINY_LLAMA,
        "vocab_size": top + 1,
        "max_position_embeddings": int(inputs.header_config["max_model_len"]) + 1,
        "eos_token_id": 2 if eos is None else eos,
    }
    d = Path(tempfile.mkdtemp(prefix="schedtop-sglang-model-"))
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def cpu_engine_args(model: str) -> dict[str, Any]:
    """SGLang on the CPU with random weights and token-id prompts (the stand-in model in
    `model`): what the driver, the tests' recording engine and the bench all start."""
    return {
        "model_path": model,
        "device": "cpu",
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "disable_cuda_graph": True,
        # the pool is max_total_tokens; a fraction this size only passes SGLang's check
        # of the memory left, on a machine where others use much of it
        "mem_fraction_static": 0.5,
        "log_level": "error",
    }


def server_args(inputs: Inputs, model: str) -> dict[str, Any]:
    """SGLang's ServerArgs for the recorded config (the header's names mapped back)."""
    c = inputs.header_config
    return {
        **cpu_engine_args(model),
        "max_total_tokens": int(c["num_blocks"]) - 1,
        "max_running_requests": int(c["max_num_seqs"]),
        "max_prefill_tokens": int(c["sglang_max_prefill_tokens"]),
        "chunked_prefill_size": c["sglang_chunked_prefill_size"],
        "schedule_policy": str(c["sglang_schedule_policy"]),
        "page_size": int(c["sglang_page_size"]),
        "schedule_conservativeness": float(c["sglang_schedule_conservativeness"]),
        "enable_mixed_chunk": bool(c["sglang_enable_mixed_chunk"]),
        "disable_overlap_schedule": not c["sglang_overlap_schedule"],
        "disable_radix_cache": not c["enable_prefix_caching"],
    }


def make_scheduler(args: dict[str, Any]) -> Any:
    """SGLang's Scheduler in this process, set up as its engine sets up the scheduler
    process (one rank, no tokenizer: nothing listens on its sockets)."""
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, ServerArgs

    sa = ServerArgs(**args)
    sa.resolve_once()
    _set_envs_and_config(sa)
    sa.check_server_args()
    ports = PortArgs.init_new(sa)
    world = spawn_world_rank(sa, tp_rank=0, pp_rank=0)
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=world, dp_rank=None, gpu_id=0))
    return Scheduler(sa, ports)


class Feeder:
    """Stands in for the scheduler's input socket and its model's sampler."""

    def __init__(self, sched: Any, inputs: Inputs) -> None:
        from recorder.sglang import hooks

        self.sched = sched
        self.inputs = inputs
        self.scripts = inputs.scripts
        self.by_rid = {s.request_id: s for s in inputs.scripts}
        self.times = {s.request_id: s.arrival.arrival_time for s in inputs.scripts}
        self.next = 0  # the next script to arrive
        self.aborts = sorted((at, ref) for ref, at in inputs.abort_at.items())
        self.next_abort = 0
        self.limit = step_limit(inputs.num_steps)
        tap = hooks._tap(sched)
        if tap is None:
            raise DriverError("schedtop's SGLang recorder did not start (see above)")
        self.tap = tap

    def _idle(self) -> bool:
        s = self.sched
        return (
            not s.waiting_queue
            and s.running_batch.is_empty()
            and s.chunked_req is None
            and not getattr(s, "result_queue", None)
            and s.last_batch is None
        )

    def ingest(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Scheduler.ingest_requests: the arrivals and aborts due before the next step."""
        tap = self.tap
        step = tap.upcoming_step()
        if step > self.limit:
            raise DriverError(f"SGLang's scheduler still running at step {step}")
        idle = self._idle()
        reqs: list[Any] = []
        scripts = self.scripts
        # Idle before the next arrival's step: the recording had steps this run has not
        # (it already differs); send it now rather than wait for ever.
        while self.next < len(scripts) and (
            scripts[self.next].arrival_step <= step or (idle and not reqs)
        ):
            reqs.append(self._request(scripts[self.next]))
            self.next += 1
        aborts = []
        while self.next_abort < len(self.aborts) and self.aborts[self.next_abort][0] <= step:
            ref = self.aborts[self.next_abort][1]
            if ref < self.next:
                aborts.append(self._abort(scripts[ref]))
                self.next_abort += 1
            else:
                break
        if reqs or aborts:
            self.sched.process_input_requests(reqs + aborts)
            # the recorded arrival times, not this run's clock
            tap.pending_arrivals[:] = [
                replace(a, arrival_time=self.times.get(a.request_id, a.arrival_time))
                for a in tap.pending_arrivals
            ]
        elif idle and self.next >= len(scripts) and self.next_abort >= len(self.aborts):
            self.sched.gracefully_exit = True  # every input in, every request done
        return reqs + aborts

    def _request(self, s: RequestScript) -> Any:
        from array import array

        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        a = s.arrival
        sp = a.sampling
        params = SamplingParams(
            max_new_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else -1,
            stop_token_ids=list(sp.stop_token_ids) or None,
            ignore_eos=sp.ignore_eos,
        )
        params.normalize(None)
        params.verify(1 << 30)
        return TokenizedGenerateReqInput(
            rid=a.request_id,
            input_text=None,
            input_ids=array("q", a.prompt_token_ids or ()),  # as its tokenizer sends them
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            priority=a.priority or None,
        )

    def _abort(self, s: RequestScript) -> Any:
        from sglang.srt.managers.io_struct import AbortReq

        return AbortReq(rid=s.request_id)

    def process_batch_result(self, original: Any, batch: Any, result: Any) -> Any:
        """Each request samples the trace's next token for it (the model's own would do
        for the scheduler, but not for the radix cache, which holds outputs too)."""
        import torch

        ids = getattr(result, "next_token_ids", None)
        if ids is not None and torch.is_tensor(ids) and ids.dim() == 1:
            if result.copy_done is not None:
                result.copy_done.synchronize()
            tokens = ids.tolist()
            for i, req in enumerate(batch.reqs[: len(tokens)]):
                script = self.by_rid.get(req.rid)
                n = len(req.output_ids)
                if script is not None and n < len(script.tokens):
                    tokens[i] = script.tokens[n]
            result.next_token_ids = torch.tensor(tokens, dtype=ids.dtype)
        return original(batch, result)


def run(trace: str, out: str) -> int:
    inputs = read_inputs(trace)
    retract = int(inputs.header_config.get("sglang_test_retract_interval", 0))
    if retract:  # read when SGLang's scheduler module is imported
        os.environ["SGLANG_TEST_RETRACT"] = "1"
        os.environ["SGLANG_TEST_RETRACT_INTERVAL"] = str(retract)
    os.environ["SCHEDTOP_TRACE_FILE"] = str(out)
    os.environ.setdefault("SCHEDTOP_STRICT", "1")  # a record that does not fit: fail
    from recorder.sglang import register

    register()
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()
    sched = make_scheduler(server_args(inputs, model_dir(inputs)))
    c = inputs.header_config
    got = (sched.max_total_num_tokens + 1, sched.max_req_len)
    if got != (c["num_blocks"], c["max_model_len"]):
        raise DriverError(
            f"SGLang made a pool of {got[0] - 1} slots and max_req_len {got[1]}; "
            f"the trace has {c['num_blocks'] - 1} and {c['max_model_len']}"
        )
    feeder = Feeder(sched, inputs)
    original = sched.process_batch_result
    sched.ingest_requests = feeder.ingest
    sched.process_batch_result = lambda batch, result: feeder.process_batch_result(
        original, batch, result
    )
    try:
        sched.run_event_loop()  # SGLang's own loop, until the feeder says it is over
    finally:
        feeder.tap.close()
    return feeder.tap.next_step


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    steps = run(argv[0], argv[1])
    print(json.dumps({"steps": steps, "trace": argv[1]}))
    sys.stdout.flush()
    # SGLang's scheduler leaves threads and sockets behind it: the run is over
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
