"""Speculative decoding (n-gram drafts) against plain decoding, on the default model, in one
process: a repetitive workload (copy or edit a given passage: the answer repeats the
prompt, so prompt lookup drafts well) and a non-repetitive one (open questions).

Each workload runs with drafts off and on, alternating off/on/off/on with --repeats, all
requests arriving at once, greedy. A request ends at EOS (its answer) or at --max-tokens;
greedy outputs are the same with drafts on and off, and the bench checks that they are.
--ignore-eos runs every request to --max-tokens instead: past the end of its answer the
small model rambles on in text that no longer repeats the prompt. The table gives output
tokens/s, TPOT p50/p99, the acceptance rate and the mean acceptance length (tokens per
verification, bonus included), and the on/off ratios.

On a machine shared with other work, wall time says more about the neighbours than about
the engine, so the runner uses one thread (--threads) and the table also gives tokens per
CPU-second of this process: `cpu tok/s` over the whole run (the prompts' prefill
included), and `dec tok/s` over the decode steps only (steps with no prefill in them,
tokens sampled in them), the decode speed a busy neighbour does not change.

    .venv/bin/python bench/spec_bench.py [--repeats 2] [--max-tokens 128] [--requests 4]
        [--speculative-config JSON] [--threads N] [--ignore-eos] [--no-adaptive-drafts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.api import RunWorkload, build_engine, run_workload  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.workload import WorkloadRequest  # noqa: E402
from engine.records import (  # noqa: E402
    Kind,
    Step,
    percentile,  # noqa: E402
)

DEFAULT_SPEC = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1}'
)
PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion, the members "
    "agreed to postpone the vote until the auditors had finished their report on the "
    "accounts of the previous year.",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return "
    "total / len(values)\n\ndef variance(values):\n    m = mean(values)\n    return "
    "sum((v - m) ** 2 for v in values) / len(values)\n",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm "
    "water slowly and knead the dough for ten minutes, until it is smooth and elastic.",
    "The station closes at midnight. Trains to the airport leave every twenty minutes from "
    "platform four; trains to the city centre leave every ten minutes from platform two.",
]
EDITS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Rewrite the following text, changing nothing but the first word:\n\n{p}",
    "Copy this text twice:\n\n{p}",
    "Repeat the following text exactly:\n\n{p}",
]
QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "What are the main causes of the French Revolution?",
    "Describe a walk through a forest in autumn.",
    "Give advice to someone learning to play the piano.",
    "Why do cats purr?",
]


@dataclass
class Result:
    """One run of one workload."""

    workload: str  # repetitive / non-repetitive
    spec: bool  # drafts on
    tok_s: float  # output tokens per second, first arrival to last finish
    cpu_tok_s: float = 0.0  # output tokens per CPU-second of this process
    dec_tok_s: float = 0.0  # tokens sampled in decode-only steps per CPU-second of them
    tpot: list[float] = field(default_factory=list)  # per request
    outputs: dict[str, list[int]] = field(default_factory=dict)  # token ids per request
    drafts: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted
    verifications: int = 0  # verifying entries


class _Acceptance:
    """A sink counting verified and accepted drafts, and the CPU time and tokens of the
    steps that hold no prefill."""

    def __init__(self, result: Result) -> None:
        self.result = result
        self.cpu = time.process_time()
        self.decode_cpu = 0.0
        self.decode_tokens = 0

    def on_step(self, report: Step) -> None:
        now = time.process_time()
        if report.num_decodes or report.scheduled:
            prefill = any(e.kind in (Kind.PREFILL, Kind.CHUNK) for e in report.scheduled)
            if not prefill:
                self.decode_cpu += now - self.cpu
                counts = report.sample_counts
                n = report.num_decodes + len(report.scheduled)
                self.decode_tokens += sum(counts) if counts is not None else n
        self.cpu = now
        if report.spec_accepted:
            drafts = {e.ref: e.num_spec_tokens for e in report.scheduled}
            for a in report.spec_accepted:
                self.result.verifications += 1
                self.result.drafts += drafts.get(a.ref, 0)
                self.result.accepted += a.accepted

    def close(self) -> None:
        pass


def workload(
    kind: str, n: int, max_tokens: int, spec: str | None, threads: int, args: Any = None
) -> RunWorkload:
    if kind == "repetitive":
        prompts = [EDITS[i % len(EDITS)].format(p=PASSAGES[i % len(PASSAGES)]) for i in range(n)]
    else:
        prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    ignore_eos = bool(args is not None and args.ignore_eos)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    reqs = [
        WorkloadRequest(
            f"{kind[:3]}{i}", messages=[{"role": "user", "content": p}], sampling=sampling
        )
        for i, p in enumerate(prompts)
    ]
    options: dict[str, Any] = {"max_num_seqs": n, "max_num_batched_tokens": 512}
    options["num_threads"] = threads
    if spec is not None:
        options["speculative_config"] = spec
        options["adaptive_drafts"] = not (args is not None and args.no_adaptive_drafts)
    return RunWorkload(kind, options, reqs, source=kind)


def run_once(loaded: Any, kind: str, args: argparse.Namespace, spec: bool) -> Result:
    w = workload(
        kind,
        args.requests,
        args.max_tokens,
        args.speculative_config if spec else None,
        args.threads,
        args,
    )
    result = Result(kind, spec, 0.0)
    sink = _Acceptance(result)
    engine = build_engine(w, loaded=loaded, sink=sink)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "outputs.jsonl"
        cpu0 = sink.cpu = time.process_time()
        summary = run_workload(w, engine=engine, outputs_path=path)
        result.cpu_tok_s = summary.output_tokens / max(time.process_time() - cpu0, 1e-9)
        for line in path.read_text().splitlines():
            record = json.loads(line)
            result.outputs[record["id"]] = record["output_token_ids"]
    result.dec_tok_s = sink.decode_tokens / max(sink.decode_cpu, 1e-9)
    result.tok_s = summary.output_tok_per_s
    result.tpot = [t.tpot for t in summary.times.values() if t.tpot is not None]  # the fold's
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ignore-eos", action="store_true", help="run every request to --max-tokens")
    ap.add_argument(
        "--no-adaptive-drafts", action="store_true", help="verify every draft (as vLLM does)"
    )
    args = ap.parse_args()
    json.loads(args.speculative_config)  # a bad option fails before the model loads
    loaded = load_model()
    results: list[Result] = []
    for kind in ("repetitive", "non-repetitive"):
        for _ in range(args.repeats):
            for spec in (False, True):
                results.append(run_once(loaded, kind, args, spec))
                r = results[-1]
                print(
                    f"  {kind:15} spec={'on ' if spec else 'off'} {r.tok_s:7.1f} tok/s "
                    f"{r.cpu_tok_s:7.1f} cpu tok/s {r.dec_tok_s:7.1f} dec tok/s",
                    flush=True,
                )
    print()
    print(f"speculative config: {args.speculative_config}")
    print(
        f"{args.requests} requests, up to {args.max_tokens} tokens"
        f"{' (EOS ignored)' if args.ignore_eos else ''}, greedy, {args.threads} thread(s), "
        f"{args.repeats} runs each (median), adaptive drafts "
        f"{'off' if args.no_adaptive_drafts else 'on'}"
    )
    print_table(results)


def print_table(results: list[Result]) -> None:
    header = (
        f"{'workload':15} {'spec':4} {'tok/s':>7} {'cpu tok/s':>9} {'dec tok/s':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'accept':>6} {'mean len':>8} {'tok/s ratio':>11} "
        f"{'cpu ratio':>9} {'dec ratio':>9} {'TPOT p50 ratio':>14}"
    )
    print(header)
    print("-" * len(header))
    same = []
    for kind in ("repetitive", "non-repetitive"):
        rows = {spec: _row(results, kind, spec) for spec in (False, True)}
        for spec in (False, True):
            tok_s, cpu, dec, p50, p99, acc, mean_len = rows[spec]
            off = rows[False]
            ratios = (
                (f"{tok_s / off[0]:.2f}x", f"{cpu / off[1]:.2f}x", f"{dec / off[2]:.2f}x")
                if spec
                else ("", "", "")
            )
            tpot_ratio = f"{p50 / off[3]:.2f}x" if spec and off[3] else ""
            print(
                f"{kind:15} {'on' if spec else 'off':4} {tok_s:7.1f} {cpu:9.1f} {dec:9.1f} "
                f"{p50 * 1e3:7.1f}ms {p99 * 1e3:7.1f}ms "
                f"{'' if acc is None else f'{acc:.0%}':>6} "
                f"{'' if mean_len is None else f'{mean_len:.2f}':>8} {ratios[0]:>11} "
                f"{ratios[1]:>9} {ratios[2]:>9} {tpot_ratio:>14}"
            )
        outputs = [r.outputs for r in results if r.workload == kind]
        same.append(f"{kind}: {'yes' if all(o == outputs[0] for o in outputs) else 'NO'}")
    print("greedy outputs identical with drafts on and off: " + ", ".join(same))


def _row(results: list[Result], kind: str, spec: bool) -> tuple[Any, ...]:
    runs = [r for r in results if r.workload == kind and r.spec == spec]
    tpot = [t for r in runs for t in r.tpot]
    drafts = sum(r.drafts for r in runs)
    v = sum(r.verifications for r in runs)
    return (
        statistics.median(r.tok_s for r in runs),
        statistics.median(r.cpu_tok_s for r in runs),
        statistics.median(r.dec_tok_s for r in runs),
        percentile(tpot, 50) or 0.0,
        percentile(tpot, 99) or 0.0,
        sum(r.accepted for r in runs) / drafts if drafts else None,
        1 + sum(r.accepted for r in runs) / v if v else None,
    )


if __name__ == "__main__":
    main()
