"""vLLM's real engine loop with no model: runs under the vLLM venv's interpreter.

    python -m tests.vllm_engine SPEC.json RESULT.json

Each run of SPEC (see main) is a fidelity workload (requests may also have
"abort_step" and "stop_token_ids"), multiprocess or not, async or not, and in-process
stepped until the batch queue is drained (vLLM's busy loop) or not ("drain": false,
LLM.generate's loop). vLLM's own
LLMEngine (and, with multiprocess, its engine-core process) runs with `FakeExecutor`
in place of a GPU worker, and with schedtop's CheckingScheduler: the recorder, plus a
comparison of the state the trace rebuilds with vLLM's live free queue, block tables,
ref counts and computed tokens after every step, written to $SCHEDTOP_CHECK_FILE.
RESULT gets the steps driven and the finished requests' ids.

This is a test helper, not shipped: the check is the "test hook" of issue 12.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# The CUDA wheel finds no platform on a machine without a GPU; the CPU platform needs
# nothing this model-free engine does not stub out.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
from vllm.v1.executor.abstract import Executor  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402

from recorder.schema import Header, Step  # noqa: E402
from recorder.vllm import RecordingMixin, RecordingScheduler  # noqa: E402
from replays.reducer import apply  # noqa: E402
from replays.state import State  # noqa: E402

SCRIPTS_ENV = "SCHEDTOP_FAKE_SCRIPTS"  # JSON file: external request id -> token script
CHECK_ENV = "SCHEDTOP_CHECK_FILE"  # where CheckingScheduler reports (one line per step)


class FakeExecutor(Executor):
    """Executes nothing: each scheduled request samples when its step reaches the end
    of its known tokens, the next token of its script (by external id)."""

    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        path = os.environ.get(SCRIPTS_ENV)
        self.scripts: dict[str, list[int]] = json.loads(Path(path).read_text()) if path else {}
        self.known: dict[str, int] = {}
        self.sampled: dict[str, int] = {}
        self.pending: Any = None

    def determine_available_memory(self) -> list[int]:
        return [1 << 30]

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:

        bs = self.vllm_config.cache_config.block_size
        return [
            {
                "layer": FullAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32
                )
            }
        ]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        pass

    def compile_or_warm_up_model(self) -> None:
        pass

    def collective_rpc(
        self,
        method: Any,
        timeout: Any = None,
        args: tuple = (),
        kwargs: Any = None,
        non_block: bool = False,
    ) -> Any:
        result: list[Any] = [("generate",) if method == "get_supported_tasks" else None]
        if non_block:
            f: Future[list[Any]] = Future()
            f.set_result(result)
            return f
        return result

    def check_health(self) -> None:
        pass

    def _token(self, rid: str) -> int:
        external = rid.rsplit("-", 1)[0]
        script = self.scripts.get(external, [])
        n = self.sampled.get(rid, 0)
        self.sampled[rid] = n + 1
        return script[n] if n < len(script) else 7

    def _run(self, out: Any) -> Any:
        for nr in out.scheduled_new_reqs:
            self.known.setdefault(nr.req_id, len(nr.prompt_token_ids or ()))
        cached = out.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens))
        for nr in out.scheduled_new_reqs:
            before[nr.req_id] = nr.num_computed_tokens
        ids = list(out.num_scheduled_tokens)
        tokens: list[list[int]] = []
        for rid in ids:
            n = out.num_scheduled_tokens[rid]
            if before[rid] + n < self.known[rid]:
                tokens.append([])
                continue
            tokens.append([self._token(rid)])
            self.known[rid] += 1
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=tokens,
        )

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self._run(scheduler_output)
        result = output
        if scheduler_output.total_num_scheduled_tokens > 0:
            self.pending, result = output, None  # sample_tokens() hands it out
        if non_block:
            f: Future[Any] = Future()
            f.set_result(result)
            return f
        return result

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output, self.pending = self.pending, None
        if non_block:
            f: Future[Any] = Future()
            f.set_result(output)
            return f
        return output

    def take_draft_token_ids(self) -> None:
        return None


def _keep_async_scheduling() -> None:
    """vLLM's CPU platform turns async scheduling off (its model runner cannot overlap);
    this engine runs no model, so keep what was asked for, as a GPU platform would."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign, assignment]


class CheckingMixin(RecordingMixin):
    """After every step, the trace's state must equal vLLM's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tap = self._schedtop
        assert tap is not None
        cfg = tap.config
        header = Header("check", "", {}, cfg.block_size, cfg.num_blocks, cfg.policy, 0, "", False)
        self._check_state = State.initial(header)
        self._check_out = Path(os.environ[CHECK_ENV])

    def schedtop_check(self, step: Step) -> None:
        apply(self._check_state, step)
        problem = self._compare()
        tap = self._schedtop
        assert tap is not None
        # How many steps so far took the recorder's short paths (the test wants both).
        line = {"step": step.step, "problem": problem, "lean": tap.lean_steps}
        line["steady"] = tap.steady_steps
        line["mixed"] = tap.mixed_steps
        line["implicit"] = tap.implicit_steps
        with self._check_out.open("a") as f:
            f.write(json.dumps(line) + "\n")

    def _compare(self) -> str:
        sched: Any = self
        tap = self._schedtop
        assert tap is not None
        state = self._check_state
        pool = tap.pool
        free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
        if tuple(state.free) != free:
            return f"free queue: trace {tuple(state.free)[:20]}... vLLM {free[:20]}..."
        tables = {r.request_id: tuple(r.block_ids) for r in state.requests.values()}
        live = {rid: tuple(b.block_id for b in tap._table(rid)) for rid in sched.requests}
        if {k: v for k, v in tables.items() if v} != {k: v for k, v in live.items() if v}:
            return f"block tables: trace {tables} vLLM {live}"
        mirror = {k: tuple(v.ids) for k, v in tap.kvreqs.items() if v.ids}
        if mirror != {k: v for k, v in live.items() if v}:
            return f"block tables: the recorder's mirror {mirror} vLLM {live}"
        blocks = pool.blocks
        for block_id, count in enumerate(state.ref_cnts):
            if block_id and blocks[block_id].ref_cnt != count:
                live_count = blocks[block_id].ref_cnt
                return f"block {block_id}: ref count {count} in the trace, {live_count} in vLLM"
        hashed = {b.block_id for b in blocks if b.block_id and b.block_hash is not None}
        if set(state.block_hashes) != hashed:
            return f"hashed blocks: trace {sorted(state.block_hashes)} vLLM {sorted(hashed)}"
        computed = {r.request_id: r.num_computed_tokens for r in state.requests.values()}
        vcomputed = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        if computed != vcomputed:
            return f"computed tokens: trace {computed} vLLM {vcomputed}"
        names = [state.requests[ref].request_id for ref in state.running]
        if names != [r.request_id for r in sched.running]:
            return "running queue differs"
        return ""


class CheckingScheduler(RecordingScheduler):
    mixin = CheckingMixin


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from replays.vllm_driver import tiny_model_dir

    workload = spec["workload"]
    cfg = workload["config"]
    scripts = {r["id"]: r.get("output_token_ids", []) for r in workload["requests"]}
    scripts_path = Path(spec["trace_dir"]) / "scripts.json"
    scripts_path.write_text(json.dumps(scripts))
    os.environ[SCRIPTS_ENV] = str(scripts_path)
    os.environ["SCHEDTOP_TRACE_DIR"] = spec["trace_dir"]
    os.environ.update(spec.get("env", {}))  # e.g. SCHEDTOP_LIVE_PORT, _TRACE_MAX_BYTES
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec["multiprocess"] else "0"
    if spec.get("check"):
        os.environ[CHECK_ENV] = str(Path(spec["trace_dir"]) / "check.jsonl")
    cls = (
        "tests.vllm_engine.CheckingScheduler"
        if spec.get("check")
        else ("recorder.vllm.RecordingScheduler")
    )
    args = EngineArgs(
        model=tiny_model_dir(),
        skip_tokenizer_init=True,
        dtype="float16",
        # vLLM refuses a pool that cannot hold one sequence of max_model_len.
        max_model_len=min(
            cfg.get("max_model_len", 4096), (cfg["num_blocks"] - 1) * cfg.get("block_size", 16)
        ),
        max_num_seqs=cfg.get("max_num_seqs", 16),
        max_num_batched_tokens=cfg.get("max_num_batched_tokens", 2048),
        block_size=cfg.get("block_size", 16),
        num_gpu_blocks_override=cfg["num_blocks"],
        enable_prefix_caching=cfg.get("enable_prefix_caching", True),
        long_prefill_token_threshold=cfg.get("long_prefill_token_threshold", 0),
        scheduling_policy=cfg.get("policy", "fcfs"),
        async_scheduling=spec["async_scheduling"],
        scheduler_cls=cls,
        distributed_executor_backend=FakeExecutor,
        enforce_eager=True,
    )
    _keep_async_scheduling()
    engine = LLMEngine.from_engine_args(args)
    by_step: dict[int, list[dict[str, Any]]] = {}
    aborts: dict[int, list[str]] = {}
    for r in workload["requests"]:
        by_step.setdefault(r.get("arrival_step", 0), []).append(r)
        if "abort_step" in r:
            aborts.setdefault(r["abort_step"], []).append(r["id"])
    finished: list[str] = []
    step = 0
    last = max(max(by_step, default=0), max(aborts, default=0))
    # "drain": step on while the in-process engine core still has a batch in flight after
    # the last finish, as vLLM's own busy loop does in its engine-core process; without it
    # the loop is LLM.generate's, which stops when no request is unfinished.
    drain = spec.get("drain", True)
    try:
        while (
            step <= last
            or engine.has_unfinished_requests()
            or (drain and _batches_in_flight(engine))
        ):
            if step > 20_000:
                raise SystemExit("the engine is still running at step 20000")
            if step == spec.get("gate_at_step"):
                # The live test's hook: wait here (vLLM idle) until a viewer is attached.
                _wait_for_file(Path(spec["trace_dir"]) / "go")
            if str(step) in spec.get("sleep_before_step", {}):
                # Wall time with nothing to do (the step-timing test's idle gap).
                time.sleep(spec["sleep_before_step"][str(step)])
            if aborts.get(step):
                engine.abort_request(aborts[step])
            for r in by_step.get(step, ()):
                outs = r.get("output_token_ids", [])
                params = SamplingParams(
                    max_tokens=r.get("max_tokens", len(outs) or 1),
                    stop_token_ids=r.get("stop_token_ids") or None,
                    ignore_eos=True,
                )
                prompt: dict[str, Any] = {"prompt_token_ids": r["prompt_token_ids"]}
                if r.get("cache_salt"):  # recorder.vllm stops recording on it
                    prompt["cache_salt"] = r["cache_salt"]
                engine.add_request(
                    r["id"],
                    prompt,
                    params,
                    priority=r.get("priority", 0),
                )
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
            step += 1
            if spec.get("step_sleep_s"):
                # A model's time per step: a live viewer sees the steps as they come.
                time.sleep(spec["step_sleep_s"])
            if step == spec.get("signal_at_step"):
                # The incident test's hook: SIGUSR1 to the process that records.
                _signal_recorder(engine)
            if step == spec.get("hang_after_steps"):
                _hang(engine, Path(spec["trace_dir"]) / "hung")
        if spec.get("gate_at_end"):  # ...and here, before shutting down
            _wait_for_file(Path(spec["trace_dir"]) / "end")
    finally:
        engine.engine_core.shutdown()
    return {"steps": step, "finished": finished}


def _wait_for_file(path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never came")
        time.sleep(0.05)


def _hang(engine: Any, marker: Path) -> None:
    """The hang-and-kill test's hook: the engine stops stepping for good (as a hung model
    call stops vLLM's engine core), after writing the last step its recorder has ended
    (with async scheduling the step just scheduled is still open) for the test to find."""
    tap = engine.engine_core.engine_core.scheduler._schedtop
    marker.write_text(str(tap.next_step - 1))
    while True:
        time.sleep(3600)


def _signal_recorder(engine: Any) -> None:
    import signal

    core = getattr(engine.engine_core, "engine_core", None)
    proc = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    if core is not None:  # in-process: this process records
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    for p in getattr(proc, "processes", ()):  # the engine-core process records
        os.kill(p.pid, signal.SIGUSR1)


def _batches_in_flight(engine: Any) -> bool:
    """In-process, the caller drives the engine core: a batch scheduled before the last
    request finished is still to be drained (vLLM's own busy loop drains it)."""
    core = getattr(engine.engine_core, "engine_core", None)
    return bool(getattr(core, "batch_queue", None))


def main(argv: list[str]) -> int:
    """SPEC {"runs": [{"name", "workload", "multiprocess", "async_scheduling"}], "root",
    "check"}: each run records into ROOT/NAME/; RESULT maps names to what happened."""
    spec = json.loads(Path(argv[0]).read_text())
    results: dict[str, Any] = {}
    for item in spec["runs"]:
        directory = Path(spec["root"]) / item["name"]
        directory.mkdir(parents=True, exist_ok=True)
        try:
            results[item["name"]] = run(
                {**item, "trace_dir": str(directory), "check": spec["check"]}
            )
        except Exception as e:  # reported per run; the test names the run
            results[item["name"]] = {"error": f"{type(e).__name__}: {e}"}
        Path(argv[1]).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
