"""The acceptance test of `schedtop serve`: the default model in a real server process on a
free loopback port, 16 concurrent streaming clients (the `openai` client and raw HTTP),
bad requests among them, an API key, a client that leaves mid-stream; then the texts
against offline `LLMEngine.generate()`, /metrics against what was sent, and the trace
against `schedtop resim`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from recorder.multi import open_trace
from recorder.schema import Client, Status, Step
from tests.model_support import have_default_model
from tests.serve_support import REPO, ServerProcess, metric, sse_events, stream_text

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(not have_default_model(), reason="the default model is not installed"),
]

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    traces = tmp_path_factory.mktemp("serve-e2e")
    with ServerProcess(["--trace-dir", str(traces)], env={"SCHEDTOP_API_KEY": KEY}) as proc:
        yield proc, traces


def requests() -> list[dict[str, Any]]:
    """16 requests: completions and chats, greedy and seeded sampling, a stop string."""
    topics = ["the sea", "a red bicycle", "winter in Oslo", "coffee", "the moon", "jazz",
              "a lighthouse", "bread"]  # fmt: skip
    out: list[dict[str, Any]] = []
    for i in range(16):
        topic = topics[i % len(topics)]
        r: dict[str, Any] = {"max_tokens": MAX_TOKENS - (i % 5), "seed": 1000 + i}
        if i % 3 == 0:
            r.update(temperature=0.0)
        else:
            r.update(temperature=0.8, top_p=0.95, top_k=40)
        if i % 2:
            r["messages"] = [{"role": "user", "content": f"Write one sentence about {topic}."}]
        else:
            r["prompt"] = f"Here is a short story about {topic}:"
        out.append(r)
    return out


def offline_texts(reqs: list[dict[str, Any]]) -> list[str]:
    """What the offline engine, built as the server builds it, gives for each request."""
    from engine.request import SamplingParams
    from schedtop_server.server import load_engine

    engine, _ = load_engine(None, {})
    prompts = [r.get("messages") or r["prompt"] for r in reqs]
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=r["temperature"],
            top_p=r.get("top_p", 1.0),
            top_k=r.get("top_k", 0),
            seed=r["seed"],
        )
        for r in reqs
    ]
    return [o.text for o in engine.generate(prompts, params)]


async def with_openai(url: str, model: str, r: dict[str, Any]) -> tuple[str, dict[str, int]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    common = dict(
        model=model,
        max_tokens=r["max_tokens"],
        temperature=r["temperature"],
        seed=r["seed"],
        stream=True,
        stream_options={"include_usage": True},
    )
    if "top_p" in r:
        common["top_p"] = r["top_p"]
        common["extra_body"] = {"top_k": r["top_k"]}
    parts: list[str] = []
    usage: dict[str, int] = {}
    if "messages" in r:
        stream: Any = await client.chat.completions.create(messages=r["messages"], **common)
        async for chunk in stream:
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage.model_dump() if chunk.usage else usage
    else:
        stream = await client.completions.create(prompt=r["prompt"], **common)
        async for chunk in stream:
            parts += [c.text for c in chunk.choices]
            usage = chunk.usage.model_dump() if chunk.usage else usage
    await client.close()
    return "".join(parts), usage


async def with_httpx(
    client: httpx.AsyncClient, model: str, r: dict[str, Any]
) -> tuple[str, dict[str, int]]:
    chat = "messages" in r
    body = {**r, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with client.stream("POST", path, json=body, headers=AUTH) as resp:
        assert resp.status_code == 200, await resp.aread()
        events = list(sse_events([line async for line in resp.aiter_lines()]))
    assert events[-1] == "[DONE]", "the stream must end with [DONE]"
    return stream_text(events, chat), events[-2]["usage"]


BAD = [
    ({"prompt": "hi", "max_tokens": 4, "bogus": True}, 400),
    ({"prompt": "hi", "n": 65}, 400),  # at most 64 choices
    ({"prompt": "word " * 9000}, 400),
    ({"messages": [{"role": "nobody", "content": "x"}]}, 400),
]


async def load(url: str, model: str, reqs: list[dict[str, Any]]) -> tuple[list[Any], list[int]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        streams = [
            with_openai(url, model, r) if i % 2 else with_httpx(client, model, r)
            for i, r in enumerate(reqs)
        ]
        bad = [
            client.post(
                "/v1/chat/completions" if "messages" in b else "/v1/completions",
                json=b,
                headers=AUTH,
            )
            for b, _ in BAD
        ]
        results = await asyncio.gather(*streams, *bad)
    return list(results[: len(reqs)]), [r.status_code for r in results[len(reqs) :]]


def test_sixteen_concurrent_streams_match_offline_and_the_trace_resimulates(
    server: tuple[ServerProcess, Path],
) -> None:
    proc, traces = server
    url = proc.url
    # Auth: /v1/* needs the key, the live stream included; probes and scrapers do not.
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/schedtop/stream").status_code == 401
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    model = httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["id"]

    reqs = requests()
    results, bad_codes = asyncio.run(load(url, model, reqs))
    assert bad_codes == [code for _, code in BAD]
    expected = offline_texts(reqs)
    for i, ((text, usage), want) in enumerate(zip(results, expected)):
        assert text == want, f"request {i}: {text!r} != offline {want!r}"
        assert usage["completion_tokens"] <= reqs[i]["max_tokens"]

    metrics = httpx.get(url + "/metrics").text
    assert metric(metrics, "vllm:prompt_tokens_total") == sum(
        u["prompt_tokens"] for _, u in results
    )
    assert metric(metrics, "vllm:generation_tokens_total") == sum(
        u["completion_tokens"] for _, u in results
    )
    done = sum(
        metric(metrics, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")
    )
    assert done == 16
    assert metric(metrics, "vllm:e2e_request_latency_seconds_count") == 16
    assert metric(metrics, "vllm:time_to_first_token_seconds_count") == 16
    assert metric(metrics, "vllm:request_queue_time_seconds_count") == 16
    assert metric(metrics, "vllm:num_requests_running", model_name=model, engine="0") == 0

    # A client that leaves mid-stream: its request is aborted and its blocks come back.
    body = {
        "prompt": "Count to one hundred:",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
        left = r.headers["x-request-id"]
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break
    deadline = time.monotonic() + 60
    while (
        metric(
            httpx.get(url + "/metrics").text, "vllm:request_success_total", finished_reason="abort"
        )
        < 1
    ):
        assert time.monotonic() < deadline, "the abort never reached the engine"
        time.sleep(0.1)

    assert proc.stop() == 0
    (trace,) = traces.iterdir()  # the run's directory of segments
    resim = subprocess.run(
        [sys.executable, "-m", "tui.cli", "resim", str(trace)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resim.returncode == 0, resim.stdout + resim.stderr
    assert "every decision reproduced" in resim.stdout
    with open_trace(trace) as reader:
        usable = reader.header.num_blocks - 1
        entries = [e.record for e in reader.entries()]
    steps = [s for s in entries if isinstance(s, Step)]
    ref = next(a.ref for s in steps for a in s.arrivals if a.request_id == left)
    finish = next(f for s in steps for f in s.finishes if f.ref == ref)
    assert finish.status == Status.FINISHED_ABORTED
    assert steps[-1].free_blocks == usable
    clients = [c for c in entries if isinstance(c, Client)]
    assert sum(c.status == 200 and c.stream for c in clients) == 17
    # the three 401s came within 10 s: counted, and recorded once (the first)
    assert sorted(c.status for c in clients if c.status >= 400) == sorted(
        [401] + [code for _, code in BAD]
    )
    (unauthenticated,) = [c for c in clients if c.status == 401]
    assert unauthenticated.endpoint == "/v1/*" and unauthenticated.message.startswith("1 ")
