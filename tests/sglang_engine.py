"""Drives SGLang's real engine on the CPU (random weights, a tiny Llama) with the schedtop
plugin loaded, through workloads of several shapes, one engine per entry of the spec:

    SGLANG's python -m tests.sglang_engine SPEC.json OUT.json

SPEC: {"root": DIR, "engines": [{"name", "env": {...}, "args": {...}, "shapes": [...]}]};
each engine records into DIR/NAME.trace; OUT says, per engine, every request sent (its
SGLang request id, prompt length and finish reason) so that tests can check that the trace
accounts for each. Runs in SGLang's venv (tests/test_sglang.py starts it).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from replays.sglang_driver import TINY_LLAMA as BASE_LLAMA
from replays.sglang_driver import cpu_engine_args

TINY_LLAMA = {
    **BASE_LLAMA,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "eos_token_id": 2,
}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 500) for _ in range(n)]


def sampling(max_new_tokens: int) -> dict[str, Any]:
    # ignore_eos: random weights would stop at random; the lengths stay the workload's
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


class Driver:
    def __init__(self, engine: Any, rng: random.Random, trace: Path) -> None:
        self.engine = engine
        self.rng = rng
        self.trace = trace
        self.sent: list[dict[str, Any]] = []
        self.count = 0
        # steps the trace file showed while the natural_retract batch was still decoding
        self.seen_mid_run = 0

    def rid(self, shape: str) -> str:
        self.count += 1
        return f"{shape}-{self.count}"

    def batch(self, shape: str, prompts: list[list[int]], max_new: int) -> None:
        rids = [self.rid(shape) for _ in prompts]
        outs = self.engine.generate(
            input_ids=prompts, sampling_params=[sampling(max_new)] * len(prompts), rid=rids
        )
        for rid, prompt, out in zip(rids, prompts, outs):
            reason = out["meta_info"]["finish_reason"]
            self.sent.append(
                {
                    "rid": rid,
                    "prompt": len(prompt),
                    "finish": reason["type"] if reason else None,
                    "output": len(out["output_ids"]),
                }
            )

    def prefix_sharing(self) -> None:
        prefix = tokens(self.rng, 48)
        self.batch("prefix", [prefix + tokens(self.rng, 4)], 4)  # fills the radix cache
        self.batch("prefix", [prefix + tokens(self.rng, 1 + i) for i in range(6)], 6)

    def chunked(self) -> None:
        self.batch("chunked", [tokens(self.rng, 300), tokens(self.rng, 170)], 5)

    def decode_heavy(self) -> None:
        self.batch("decode", [tokens(self.rng, 20 + i) for i in range(8)], 40)

    def evictions(self) -> None:
        """After decode_heavy (about 500 slots of finished requests left in the radix
        cache, evictable, of 1,024): four prompts of 200 tokens need about 800 slots, more
        than are free, so SGLang evicts cached ones to allocate them."""
        self.batch("evict", [tokens(self.rng, 200) for _ in range(4)], 4)

    def natural_retract(self) -> None:
        """Sixteen requests whose outputs outgrow a small pool, SGLang retracting on its
        own (no SGLANG_TEST_RETRACT). SGLang admits a new request if the pool holds all
        its tokens (prompt and max_new_tokens) beside an estimate of what the running
        ones will still decode: 0.7 of their remaining max_new_tokens (its new-token
        ratio; all of it for a request that ignores EOS). So seven sent first are admitted
        and decode; the nine sent once they stream find room for three (1,024 slots, 116 a
        request, the seven reserving 0.7 of theirs), and the ten need 1,160 slots at the
        end: the decode retracts. While they decode, the trace file must already show
        their steps: the recorder's flush timer writes them, the scheduler never going
        idle."""
        engine = self.engine
        prompts = [tokens(self.rng, 16) for _ in range(16)]
        rids = [self.rid("natural") for _ in prompts]
        done: dict[str, Any] = {}

        async def one(rid: str, prompt: list[int]) -> None:
            # not ignore_eos: SGLang reserves a request's whole max_new_tokens when it
            # ignores EOS, and then never admits more than the pool holds
            params = {**sampling(100), "ignore_eos": False}
            gen = await engine.async_generate(
                input_ids=prompt, sampling_params=params, rid=rid, stream=True
            )
            async for chunk in gen:
                done[rid] = chunk
            done[rid] = {**(done.get(rid) or {}), "over": True}

        async def watch() -> None:
            while sum(1 for d in done.values() if d.get("over")) < len(rids):
                if self.trace.exists():
                    steps = recorded_steps(self.trace)
                    if steps and sum(1 for d in done.values() if d.get("over")) < len(rids):
                        self.seen_mid_run = max(self.seen_mid_run, steps)
                await asyncio.sleep(0.05)  # polls the file: the writer is another process

        async def main() -> None:
            first = [asyncio.ensure_future(one(r, p)) for r, p in zip(rids[:7], prompts[:7])]
            while not all(r in done for r in rids[:7]):  # the seven stream: admitted
                await asyncio.sleep(0.01)
            rest = [asyncio.ensure_future(one(r, p)) for r, p in zip(rids[7:], prompts[7:])]
            await asyncio.gather(watch(), *first, *rest)

        engine.loop.run_until_complete(main())
        for rid, prompt in zip(rids, prompts):
            reason = done[rid].get("meta_info", {}).get("finish_reason")
            self.sent.append(
                {
                    "rid": rid,
                    "prompt": len(prompt),
                    "finish": reason["type"] if reason else None,
                    "output": len(done[rid].get("output_ids", ())),
                }
            )

    def aborts(self) -> None:
        """Eight long requests: two aborted once they stream, two while they wait."""
        engine = self.engine
        prompts = [tokens(self.rng, 16 + i) for i in range(8)]
        rids = [self.rid("abort") for _ in prompts]
        results: dict[str, Any] = {}

        async def one(rid: str, prompt: list[int]) -> None:
            gen = await engine.async_generate(
                input_ids=prompt, sampling_params=sampling(200), rid=rid, stream=True
            )
            last = None
            async for chunk in gen:
                last = chunk
                if rid in rids[:2] and len(chunk.get("output_ids", ())) >= 3:
                    engine.tokenizer_manager.abort_request(rid)
            results[rid] = last

        async def main() -> None:
            tasks = [asyncio.ensure_future(one(r, p)) for r, p in zip(rids, prompts)]
            await asyncio.sleep(0.05)
            for rid in rids[-2:]:  # the last ones wait behind max_running_requests
                engine.tokenizer_manager.abort_request(rid)
            await asyncio.gather(*tasks, return_exceptions=True)

        engine.loop.run_until_complete(main())
        for rid, prompt in zip(rids, prompts):
            last = results.get(rid)
            reason = (last or {}).get("meta_info", {}).get("finish_reason")
            self.sent.append(
                {
                    "rid": rid,
                    "prompt": len(prompt),
                    "finish": reason["type"] if reason else "abort",
                    "output": None,
                }
            )


def recorded_steps(trace: Path) -> int:
    """Step records a reader sees in the file now (a growing file's cut tail aside)."""
    from recorder.reader import TraceReader

    try:
        with TraceReader(trace) as reader:
            return sum(1 for _ in reader.steps())
    except Exception:  # the header not written yet
        return 0


def kill_scheduler(engine: Any) -> int:
    """SIGKILL SGLang's scheduler process, as its own shutdown does (and the kernel's OOM
    killer, or an operator): the recorder gets no chance to write a footer."""
    import signal

    import psutil

    for child in psutil.Process().children(recursive=True):
        try:  # the engines before this one left their killed schedulers as zombies
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "scheduler" not in child.name() + " ".join(child.cmdline()):
                continue
        except psutil.Error:
            continue
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=60)
        return int(child.pid)
    raise RuntimeError("no SGLang scheduler process to kill")


def wait_recorded(trace: Path, n: int, timeout_s: float = 120.0) -> None:
    """Until the trace holds `n` finishes (or `timeout_s` passes): SGLang's shutdown kills
    its scheduler process, and on a loaded machine the kill can come before the recorder's
    thread has written the last steps (docs/sglang.md, limits)."""
    from recorder.reader import TraceReader

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trace.exists():
            with TraceReader(trace) as reader:
                if sum(len(s.finishes) for s in reader.steps()) >= n:
                    return
        time.sleep(0.05)  # polls the file: the condition is in another process


def run_engine(root: Path, spec: dict[str, Any]) -> dict[str, Any]:
    import sglang as sgl

    model = root / f"{spec['name']}-model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    trace = root / f"{spec['name']}.trace"
    os.environ["SCHEDTOP_TRACE_FILE"] = str(trace)  # the scheduler process inherits it
    for key, value in spec.get("env", {}).items():
        os.environ[key] = str(value)
    args = {**cpu_engine_args(str(model)), **spec.get("args", {})}
    engine = sgl.Engine(**args)
    driver = Driver(engine, random.Random(spec.get("seed", 0)), trace)
    error = None
    killed = None
    try:
        for shape in spec["shapes"]:
            getattr(driver, shape)()
        wait_recorded(trace, len(driver.sent))
        if spec.get("kill"):
            killed = kill_scheduler(engine)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        engine.shutdown()
        for key in spec.get("env", {}):
            os.environ.pop(key, None)
    return {
        "trace": str(trace),
        "sent": driver.sent,
        "error": error,
        "seen_mid_run": driver.seen_mid_run,
        "killed": killed,
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    root = Path(spec["root"])
    os.environ.setdefault("SGLANG_PLUGINS", "schedtop")
    out = {e["name"]: run_engine(root, e) for e in spec["engines"]}
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":  # SGLang spawns its scheduler process: the guard is needed
    main()
