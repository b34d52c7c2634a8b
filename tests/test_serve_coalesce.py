"""The engine loop, woken from idle by a request, waits a little for others before its
first step (schedtop_server.loop.COALESCE_*), so that clients that start together are
prefilled together: `vllm bench serve` at a fixed concurrency otherwise had one request
prefilled alone every wave, a step in which nothing else advanced (issue 26 done-when 1)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import schedtop_server.loop as engine_loop
from recorder.reader import TraceReader
from tests.test_serve_app import completion, run, served


def test_a_request_arriving_during_the_wait_joins_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B is sent only once the engine thread has taken A in: without the wait A would
    be stepped alone. The wait is made long (a minute) and ends early because the batch
    is full (max_num_seqs 2), so nothing here depends on timing."""
    trace = tmp_path / "c.trace"
    monkeypatch.setattr(engine_loop, "COALESCE_STEP_FRACTION", 1e9)
    monkeypatch.setattr(engine_loop, "COALESCE_MAX_S", 60.0)
    b: dict[str, Any] = {"prompt": "the same start", "max_tokens": 3, "ignore_eos": True}

    async def go() -> None:
        async with served(trace, max_num_seqs=2) as (client, loop):
            await completion(client, {**b, "prompt": "warm up"})  # a step time to scale by
            added = loop.stats.added
            first = asyncio.ensure_future(client.post("/v1/completions", json=b))
            while loop.stats.added == added:  # the engine thread has A, and waits
                await asyncio.sleep(0.005)
            assert loop.stats.steps == 3  # the warm-up's only: A is not stepped yet
            second = await client.post("/v1/completions", json=b)
            assert (await first).status_code == 200 and second.status_code == 200

    run(go())
    with TraceReader(trace) as reader:
        steps = list(reader.steps())
    admitted = [len(s.admissions) for s in steps]
    assert admitted[:2] == [1, 0] and admitted[3] == 2  # warm-up; then A and B together


def test_no_wait_before_the_first_step_ever() -> None:
    """No step time measured yet (the first request of a server): nothing to scale the
    wait by, so none; a lone request is served as before."""

    async def go() -> None:
        async with served() as (client, loop):
            assert loop._step_s == 0.0
            out = await completion(client, {"prompt": "hello", "max_tokens": 2})
            assert out["usage"]["completion_tokens"] == 2
            assert loop._step_s > 0.0

    run(go())
