"""`vllm bench serve` against `schedtop serve`, and the same prompts through offline
`LLMEngine.generate()`, in one run, on the default model (issue 26's done-when: the
server's output tok/s at least 90% of offline).

`vllm bench serve --backend openai --dataset-name random --ignore-eos --temperature 0`
sends N (200) prompts of I (64) random tokens, M (64) output tokens each, at
--max-concurrency C (16). The very prompts it sends are read back from vLLM itself: its
own get_samples() on the same arguments (the random dataset has its own seeded
generator), run in vLLM's interpreter. Offline generate() then gets those texts and
lengths, greedy, EOS ignored, twice: with max_num_seqs C, the load the server had (the
like-for-like figure), and with the engine's default max_num_seqs (all N at once: the
engine's best batch, which no client at concurrency C could give the server). The runs
alternate, server first, so that a noisy neighbour hurts each side.

    .venv/bin/python bench/vllm_serve_bench.py [--num-prompts 200] [--concurrency 16]
        [--input-len 64] [--output-len 64] [--repeats 1] [--vllm-python PATH]

vLLM's interpreter: --vllm-python, else $SCHEDTOP_VLLM_PYTHON, else .venv-vllm/bin/python.
The Hugging Face tokenizer vLLM's client needs is built from the default model's GGUF
file by transformers (the main venv's), in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_bench import Server  # noqa: E402


def vllm_python(given: str | None) -> Path:
    for candidate in (
        given,
        os.environ.get("SCHEDTOP_VLLM_PYTHON"),
        ROOT / ".venv-vllm/bin/python",
    ):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise SystemExit("vllm_serve_bench: no vLLM interpreter (--vllm-python, $SCHEDTOP_VLLM_PYTHON)")


def hf_tokenizer(out: Path) -> Path:
    from transformers import AutoTokenizer

    from engine.model.loader import default_model_path

    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


# Run in vLLM's interpreter: the requests `vllm bench serve` would send for these
# arguments, from its own dataset code.
DUMP = """
import json, sys
from vllm.benchmarks.datasets.datasets import get_samples
from vllm.benchmarks.serve import add_cli_args
from vllm.tokenizers import get_tokenizer
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
tok = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode)
reqs = get_samples(args, tok)
print(json.dumps([[r.prompt, r.expected_output_len] for r in reqs]))
"""


def bench_args(model: str, tokenizer: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--backend", "openai", "--endpoint", "/v1/completions", "--model", model,
        "--tokenizer", str(tokenizer), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--ignore-eos", "--temperature", "0", "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--seed", str(args.seed),
    ]  # fmt: skip


def vllm_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": "", "VLLM_LOGGING_LEVEL": "WARNING"}


def sent_prompts(python: Path, common: list[str]) -> list[tuple[str, int]]:
    out = subprocess.run(
        [str(python), "-c", DUMP, *common], capture_output=True, text=True, env=vllm_env()
    )
    if out.returncode != 0:
        raise SystemExit(f"reading vLLM's prompts failed:\n{out.stderr[-3000:]}")
    return [(p, n) for p, n in json.loads(out.stdout.strip().splitlines()[-1])]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_vllm_bench(python: Path, url: str, common: list[str]) -> dict[str, Any]:
    """vLLM's result, plus `client_cpu_s`: the CPU seconds the load generator used."""
    vllm = python.with_name("vllm")
    before = children_cpu_s()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(vllm), "bench", "serve", "--base-url", url, *common, "--save-result",
               "--result-dir", tmp, "--result-filename", "r.json", "--disable-tqdm"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(), cwd=tmp)
        if out.returncode != 0:
            raise SystemExit(f"vllm bench serve failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        result: dict[str, Any] = json.loads((Path(tmp) / "r.json").read_text())
        result["client_cpu_s"] = children_cpu_s() - before
        return result


def server_cpu_s(server: Server) -> float:
    times = server.ps.cpu_times()
    return float(times.user + times.system)


def server_steps(server: Server) -> float:
    # one observation of the iteration-tokens histogram per engine step
    return server.metrics().get("vllm:iteration_tokens_total_count", 0.0)


def offline(prompts: list[tuple[str, int]], max_num_seqs: int | None) -> dict[str, float]:
    from engine.config import EngineConfig
    from engine.model.llm_engine import LLMEngine
    from engine.request import SamplingParams

    config = EngineConfig() if max_num_seqs is None else EngineConfig(max_num_seqs=max_num_seqs)
    engine = LLMEngine.from_model(None, config)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in prompts]
    steps = 0
    step = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted  # type: ignore[method-assign]
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = engine.generate([p for p, _ in prompts], params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(o.output_token_ids) for o in outs)
    engine.close()
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "cpu_s": cpu, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="server/offline rounds, alternated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python")
    args = ap.parse_args()
    python = vllm_python(args.vllm_python)
    server_runs: list[dict[str, Any]] = []
    same: list[dict[str, float]] = []
    best: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        tokenizer = hf_tokenizer(base / "tokenizer")
        prompts: list[tuple[str, int]] = []
        for _ in range(args.repeats):
            (base / "traces").mkdir(exist_ok=True)
            server = Server(base / "traces")
            try:
                import httpx

                model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                common = bench_args(model, tokenizer, args)
                prompts = prompts or sent_prompts(python, common)
                cpu0, steps0 = server_cpu_s(server), server_steps(server)
                result = run_vllm_bench(python, server.url, common)
                result["server_cpu_s"] = server_cpu_s(server) - cpu0
                result["steps"] = server_steps(server) - steps0
                server_runs.append(result)
            finally:
                server.stop()
            same.append(offline(prompts, args.concurrency))
            best.append(offline(prompts, None))
    report(server_runs, same, best, args)


def report(
    server: list[dict[str, Any]],
    same: list[dict[str, float]],
    best: list[dict[str, float]],
    args: argparse.Namespace,
) -> None:
    completed = sum(r["completed"] for r in server)
    failed = sum(r.get("failed", 0) for r in server)
    s_tok = sum(r["output_throughput"] for r in server) / len(server)
    c_tok = sum(r["tokens"] for r in same) / len(same)
    o_tok = sum(r["tok_s"] for r in same) / len(same)
    b_tok = sum(r["tok_s"] for r in best) / len(best)
    s_tokens = sum(r["total_output_tokens"] for r in server) / len(server)
    print(
        f"{args.num_prompts} prompts of {args.input_len} random tokens, {args.output_len} "
        f"output tokens each (EOS ignored, greedy), {len(server)} round(s)"
    )
    print(
        f"vllm bench serve: {completed} completed, {failed} failed, concurrency {args.concurrency}"
    )
    rows = [
        ("output tokens", f"{s_tokens:.0f}", f"{c_tok:.0f}", ""),
        ("output tok/s", f"{s_tok:.1f}", f"{o_tok:.1f}", f"{s_tok / o_tok:.1%}"),
        (f"vs offline, all {args.num_prompts} at once", "", f"{b_tok:.1f}", f"{s_tok / b_tok:.1%}"),
    ]
    o_wall = sum(r["wall_s"] for r in same) / len(same)
    s_wall = sum(r["duration"] for r in server) / len(server)
    o_cpu = sum(r["cpu_s"] for r in same) / len(same)
    s_cpu = sum(r["server_cpu_s"] for r in server) / len(server)
    c_cpu = sum(r["client_cpu_s"] for r in server) / len(server)
    # Where the cores went: on a 2-core machine the load generator's CPU is taken from
    # the engine, which the offline side never pays.
    s_steps = sum(r["steps"] for r in server) / len(server)
    o_steps = sum(r["steps"] for r in same) / len(same)
    rows += [
        ("engine steps", f"{s_steps:.0f}", f"{o_steps:.0f}", f"{s_steps / o_steps:.1%}"),
        ("wall s", f"{s_wall:.1f}", f"{o_wall:.1f}", ""),
        ("CPU s: engine process", f"{s_cpu:.1f}", f"{o_cpu:.1f}", f"{s_cpu / o_cpu:.1%}"),
        ("CPU s: load generator (vllm)", f"{c_cpu:.1f}", "", ""),
    ]
    for r in server:
        rows.append(
            ("server TTFT p50/p99", f"{r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms", "", "")
        )
        rows.append(
            ("server ITL p50/p99", f"{r['median_itl_ms']:.0f}/{r['p99_itl_ms']:.0f} ms", "", "")
        )
    head = (
        f"{'':<34} {'server':>16} {f'offline ({args.concurrency} seqs)':>18} {'server/offline':>15}"
    )
    print(head)
    for name, a, b, ratio in rows:
        print(f"{name:<34} {a:>16} {b:>18} {ratio:>15}")


if __name__ == "__main__":
    main()
