"""Two data-parallel ranks of vLLM's AsyncLLM (`data_parallel_size=2`: two engine-core
processes) with the model-free executor of tests/vllm_engine.py, each rank recorded by
recorder.vllm into OUT/. Run in vLLM's interpreter: python -m tests.vllm_dp OUT"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

REQUESTS = [
    {"id": f"q{i}", "prompt": list(range(10 * i, 10 * i + 20 + 8 * i)), "n": 5 + i}
    for i in range(8)
]


async def run(out: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from replays.vllm_driver import tiny_model_dir
    from tests.vllm_engine import SCRIPTS_ENV, FakeExecutor

    scripts = out.parent / "scripts.json"  # outside OUT: it holds only the rank traces
    scripts.write_text(json.dumps({r["id"]: [7] * r["n"] for r in REQUESTS}))
    os.environ[SCRIPTS_ENV] = str(scripts)
    os.environ["SCHEDTOP_TRACE_DIR"] = str(out)
    args = AsyncEngineArgs(
        model=tiny_model_dir(),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=512,
        max_num_seqs=8,
        block_size=16,
        num_gpu_blocks_override=64,
        scheduler_cls="recorder.vllm.RecordingScheduler",
        distributed_executor_backend=FakeExecutor,
        enforce_eager=True,
        data_parallel_size=2,
        async_scheduling=False,
    )
    llm = AsyncLLM.from_engine_args(args)

    async def one(r: dict[str, Any]) -> None:
        params = SamplingParams(max_tokens=r["n"], ignore_eos=True)
        async for _ in llm.generate({"prompt_token_ids": r["prompt"]}, params, r["id"]):
            pass

    try:
        await asyncio.gather(*(one(r) for r in REQUESTS))
    finally:
        llm.shutdown()


if __name__ == "__main__":  # the engine-core processes are spawned: they import this
    asyncio.run(run(Path(sys.argv[1])))
