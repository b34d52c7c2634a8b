"""`schedtop run` as one library call: load a model and a workload, run the real engine
with arrivals on the wall clock, write per-request outputs, summarise.

`run_workload` takes an EventSink, handed to the EngineCore, so that a recorder can
observe every step of a real run exactly as it observes a simulated one."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig, Options, RunnerOptions
from engine.events import NULL_SINK, EventSink
from engine.limits import MAX_TOKENS
from engine.metrics import MetricsSink, RequestTimes, RunMetrics
from engine.model.errors import RequestError
from engine.model.workload import RunWorkload, WorkloadRequest, load_run_workload, run_options
from engine.records import printable
from engine.request import SamplingParams
from engine.workload_file import WorkloadError, atomic_output

if TYPE_CHECKING:  # keep torch out of this module's import
    from engine.model.llm_engine import LLMEngine, RequestOutput
    from engine.model.loader import LoadedModel

Progress = Callable[[int, int, int], None]  # (finished, total, output tokens so far)


def default_workload_path() -> Path:
    """The built-in workload shipped with the package."""
    return Path(str(resources.files("engine") / "data" / "default_workload.json"))


def load(path: str | Path | None) -> RunWorkload:
    return load_run_workload(path or default_workload_path())


@dataclass
class RunSummary:
    """One run: what ran, and its figures from engine.metrics (the fold `stats` and
    `whatif` use on its trace; docs/metrics.md)."""

    model: str  # what ran
    setup: str  # device, dtype, attention backend, KV pool
    num_requests: int = 0  # in the workload
    num_finished: int = 0  # finished without error
    errors: list[tuple[str, str]] = field(default_factory=list)  # (id, message) refused/failed
    metrics: RunMetrics | None = None  # the engine's steps folded (None: it never stepped)
    times: dict[str, RequestTimes] = field(default_factory=dict)  # per request id, the fold's

    @property
    def num_steps(self) -> int:
        return self.metrics.num_steps if self.metrics else 0

    @property
    def elapsed_s(self) -> float:
        """First arrival to the last step's end."""
        return self.metrics.duration if self.metrics else 0.0

    @property
    def output_tokens(self) -> int:
        return self.metrics.output_tokens if self.metrics else 0

    @property
    def prompt_tokens(self) -> int:
        return self.metrics.prompt_tokens if self.metrics else 0

    @property
    def num_preemptions(self) -> int:
        return self.metrics.preemptions if self.metrics else 0

    @property
    def cached_tokens(self) -> int:
        """Prefix-cache hits at first admissions (vLLM's prefix_cache_hits)."""
        return self.metrics.prefix_hit_tokens if self.metrics else 0

    @property
    def output_tok_per_s(self) -> float:
        return self.metrics.throughput if self.metrics else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.metrics.prefix_hit_rate if self.metrics else 0.0


def engine_config(options: Options, max_position: int) -> EngineConfig:
    """The EngineConfig for a model whose context is `max_position` tokens."""
    try:
        return options.engine_config(max_position)
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"config: {e}") from None


def runner_options(options: Options) -> RunnerOptions:
    try:
        return options.runner_options()
    except (ValueError, TypeError) as e:
        raise WorkloadError(f"config: {e}") from None


def build_engine(
    workload: RunWorkload | None = None,
    model: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    sink: EventSink = NULL_SINK,
    loaded: LoadedModel | None = None,
) -> LLMEngine:
    """The engine of `run` and `serve`: the knobs' defaults, then the workload's config,
    then the command line's `overrides` (None = not given). `loaded` reuses a loaded model."""
    from engine.model.llm_engine import LLMEngine
    from engine.model.loader import load_model

    options = workload.merged(overrides or {}) if workload else run_options(overrides or {})
    # every option is checked before the model loads: a typo costs no load time
    runner = runner_options(options)
    engine_config(options, MAX_TOKENS)
    own = loaded is None
    if loaded is None:
        loaded = load_model(model if model is not None or workload is None else workload.model)
    engine = LLMEngine(loaded, engine_config(options, loaded.spec.max_position), runner, sink)
    if own:
        loaded.weights.clear()  # the model keeps its own (fused) copies; free the rest
    return engine


def run_workload(
    workload: RunWorkload,
    model: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    outputs_path: str | Path | None = None,
    sink: EventSink = NULL_SINK,
    on_progress: Progress | None = None,
    engine: LLMEngine | None = None,
    on_engine: Callable[[LLMEngine], None] | None = None,
) -> RunSummary:
    """Run `workload` on the real engine and summarise it; with `outputs_path`, write one
    JSON line per request (written only if the whole run succeeds). `engine` reuses a
    built engine (build_engine); `on_progress` sees (finished, total, output tokens) after
    every step; `on_engine` gets the engine before its first step (a recorder attaches)."""
    if outputs_path is not None:
        check_output_dir(outputs_path)
    if engine is None:
        engine = build_engine(workload, model, overrides, sink)
    return _run(engine, workload, outputs_path, on_progress, on_engine)


def _run(
    engine: LLMEngine,
    workload: RunWorkload,
    outputs_path: str | Path | None,
    on_progress: Progress | None,
    on_engine: Callable[[LLMEngine], None] | None,
) -> RunSummary:
    if on_engine is not None:
        on_engine(engine)
    # The fold sees every step first-hand, on the engine's clock (the arrivals' clock),
    # before a recorder attached above stamps it: the two read their clocks µs apart.
    core = engine.core
    folding = MetricsSink(engine.clock, core.sink)
    core.sink = folding
    runner = engine.runner
    summary = RunSummary(
        model=engine.model.spec.name,
        setup=(
            f"{runner.device.type}, {str(runner.model.dtype).removeprefix('torch.')}, attention "
            f"{runner.model.attention.name}, KV {engine.config.num_blocks} blocks x "
            f"{engine.config.block_size} tokens ({runner.kv.nbytes / 2**30:.2f} GiB)"
        ),
        num_requests=len(workload.requests),
    )
    outputs = _drive(engine, workload.requests, on_progress)
    engine.close()
    summary.metrics = folding.metrics()
    summary.times = folding.request_times()
    for out in outputs.values():
        _observe(summary, out)
    if outputs_path is not None:
        outs = [outputs[r.id] for r in workload.requests]
        _write_outputs(outputs_path, outs, summary.times)
    return summary


def check_output_dir(path: str | Path) -> None:
    """Fail before the run, not after it, when its output file could not be created."""
    parent = Path(path).parent
    if not parent.is_dir():
        raise WorkloadError(f"{path}: cannot write: no directory {parent}")
    if not os.access(parent, os.W_OK):
        raise WorkloadError(f"{path}: cannot write: {parent} is not writable")


def _drive(
    engine: LLMEngine,
    requests: list[WorkloadRequest],
    on_progress: Progress | None,
) -> dict[str, RequestOutput]:
    """Add each request when its arrival time comes; step while there is work."""
    clock = engine.clock
    done: dict[str, RequestOutput] = {}
    tokens = 0
    t0 = clock()
    i = 0
    while i < len(requests) or engine.has_unfinished():
        now = clock()
        while i < len(requests) and t0 + requests[i].arrival_time <= now:
            out = _add(engine, requests[i], t0)
            if out.finished:
                done[out.request_id] = out
            i += 1
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id not in done:
                    done[out.request_id] = out
                    tokens += len(out.output_token_ids)
        elif i < len(requests):
            time.sleep(max(0.0, t0 + requests[i].arrival_time - clock()))
        if on_progress is not None:
            on_progress(len(done), len(requests), tokens)
    return done


def _add(engine: LLMEngine, r: WorkloadRequest, t0: float) -> RequestOutput:
    """Queue one request; a refused one comes back finished with an error."""
    from engine.model.llm_engine import RequestOutput

    arrival = t0 + r.arrival_time
    try:
        params = SamplingParams(**r.sampling)
        engine.add_request(
            r.id, r.prompt_input, params, arrival_time=arrival, priority=r.priority, tenant=r.tenant
        )
    except (RequestError, ValueError, TypeError) as e:
        return RequestOutput(
            r.id,
            [],
            [],
            "",
            True,
            "error",
            finish_message=str(e),
            arrival_time=arrival,
            finish_time=arrival,
        )
    return engine.output(r.id)


def _observe(s: RunSummary, out: RequestOutput) -> None:
    if out.finish_reason == "error":
        s.errors.append((out.request_id, out.finish_message))
        return
    s.num_finished += 1


def output_record(out: RequestOutput, times: RequestTimes | None = None) -> dict[str, Any]:
    """One line of the --outputs file (docs/workload-format.md); `times`: the request's
    latencies from the run's fold (engine.metrics), the numbers the summary's percentiles
    are of (None: the fold has none for it)."""
    record: dict[str, Any] = {
        "id": out.request_id,
        "prompt_token_ids": out.prompt_token_ids,
        "output_token_ids": out.output_token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "num_preemptions": out.num_preemptions,
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": None if times is None else times.ttft,
        "tpot_s": None if times is None else times.tpot,
    }
    if out.finish_message:
        record["error"] = out.finish_message
    return record


def _write_outputs(
    path: str | Path, outputs: list[RequestOutput], times: dict[str, RequestTimes]
) -> None:
    with atomic_output(path) as f:
        for out in outputs:
            f.write(json.dumps(output_record(out, times.get(out.request_id))) + "\n")


def format_summary(s: RunSummary) -> str:
    def secs(v: float | None) -> str:
        return "-" if v is None else (f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s")

    m = s.metrics
    ttft = (None, None) if m is None else (m.ttft_p50, m.ttft_p99)
    tpot = (None, None) if m is None else (m.tpot_p50, m.tpot_p99)
    lines = [
        f"model {s.model}   ({s.setup})",
        f"requests {s.num_requests} (finished {s.num_finished}, errors {len(s.errors)})   "
        f"steps {s.num_steps}   elapsed {s.elapsed_s:.1f} s",
        f"output tokens {s.output_tokens} ({s.output_tok_per_s:.1f} tok/s)   "
        f"prompt tokens {s.prompt_tokens}",
        f"engine TTFT p50 {secs(ttft[0])}  p99 {secs(ttft[1])}   "
        f"TPOT p50 {secs(tpot[0])}  p99 {secs(tpot[1])}   (docs/metrics.md)",
        f"preemptions {s.num_preemptions}   prefix-hit rate {s.prefix_hit_rate:.1%}",
    ]
    for rid, message in s.errors[:10]:
        lines.append(f"error: request {rid!r}: {message}")
    if len(s.errors) > 10:
        lines.append(f"... {len(s.errors) - 10} more errors")
    return printable("\n".join(lines))  # request ids and messages come from the workload
