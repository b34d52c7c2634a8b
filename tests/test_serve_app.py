"""`schedtop serve`'s routes in process, on the tiny random model: texts equal offline
generate(), stop strings, OpenAI-style errors, auth, back-pressure, metrics, and the
CLIENT records of the trace."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import RunnerOptions
from engine.request import SamplingParams
from recorder.reader import TraceReader
from recorder.recorder import open_recording
from recorder.schema import Client, Status, Step
from replays.resim import resimulate
from schedtop_server.app import ServeSettings
from schedtop_server.loop import EngineLoop
from schedtop_server.server import build
from tests.model_support import tiny_engine, tiny_model
from tests.serve_support import metric, sse_events, stream_text

MODEL = tiny_model()

Call = Callable[..., Awaitable[httpx.Response]]


@asynccontextmanager
async def served(
    trace: Path | None = None,
    api_key: str | None = None,
    max_waiting: int = 0,
    options: RunnerOptions | None = None,
    **config: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, EngineLoop]]:
    engine = tiny_engine(MODEL, options, **config)
    recorder = open_recording(engine.core, trace) if trace is not None else None
    settings = ServeSettings("tiny", engine.config.max_model_len, api_key=api_key)
    app, loop = build(engine, settings, max_waiting)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                yield client, loop
    finally:
        if recorder is not None:
            recorder.close()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


PROMPTS = ["the quick brown fox", "hello there", "a b c d e f", "zzz"]


def offline(prompts: list[str], params: list[SamplingParams]) -> list[str]:
    return [o.text for o in tiny_engine(MODEL).generate(prompts, params)]


def body(i: int, prompt: str, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 6 + i, "temperature": 0.0 if i % 2 else 0.9,
            "seed": 100 + i, "stream": stream, **extra}  # fmt: skip


def params_of(b: dict[str, Any]) -> SamplingParams:
    return SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"], seed=b["seed"])


async def completion(client: httpx.AsyncClient, b: dict[str, Any], chat: bool = False) -> Any:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = await client.post(path, json=b)
    assert r.status_code == 200, r.text
    if not b.get("stream"):
        return r.json()
    events = list(sse_events(r.text.splitlines()))
    assert events[-1] == "[DONE]"
    return events


def test_concurrent_requests_give_the_texts_of_offline_generate(tmp_path: Path) -> None:
    bodies = [body(i, p, stream=i < 2) for i, p in enumerate(PROMPTS)]
    bodies[0]["stream_options"] = {"include_usage": True}
    expected = offline(PROMPTS, [params_of(b) for b in bodies])

    async def go() -> tuple[list[Any], str]:
        async with served(tmp_path / "t.trace") as (client, _):
            results = await asyncio.gather(*(completion(client, b) for b in bodies))
            return list(results), (await client.get("/metrics")).text

    results, metrics = run(go())
    prompt_total = completion_total = 0
    for b, want, got in zip(bodies, expected, results):
        if b["stream"]:
            assert stream_text(got, chat=False) == want
            finishes = [c["finish_reason"] for e in got[:-1] for c in e["choices"]]
            assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
        else:
            assert got["choices"][0]["text"] == want
            assert got["choices"][0]["finish_reason"] == "length"
            assert got["usage"]["completion_tokens"] == b["max_tokens"]
            prompt_total += got["usage"]["prompt_tokens"]
        completion_total += b["max_tokens"]
    usage = results[0][-2]["usage"]
    assert usage["completion_tokens"] == bodies[0]["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert metric(metrics, "vllm:generation_tokens_total") == completion_total
    assert metric(metrics, "vllm:request_success_total", finished_reason="length") == 4
    assert metric(metrics, "vllm:e2e_request_latency_seconds_count") == 4
    assert metric(metrics, "vllm:time_to_first_token_seconds_count") == 4
    assert metric(metrics, "vllm:inter_token_latency_seconds_count") == completion_total - 4
    assert metric(metrics, "vllm:num_requests_running", model_name="tiny", engine="0") == 0

    # The trace: every decision re-simulates; one CLIENT record per request, 200 each.
    assert resimulate(tmp_path / "t.trace").divergence is None
    with TraceReader(tmp_path / "t.trace") as reader:
        clients = [e.record for e in reader.entries() if isinstance(e.record, Client)]
    assert sorted(c.status for c in clients) == [200] * 4
    assert sorted(c.completion_tokens for c in clients) == sorted(b["max_tokens"] for b in bodies)
    streamed = [c for c in clients if c.stream]
    assert len(streamed) == 2
    for c in streamed:  # one gap per token chunk after the first
        assert c.ttft_ns is not None and c.queue_ns is not None and c.e2e_ns >= c.ttft_ns
        assert 1 <= len(c.itl_ns) < c.completion_tokens


def test_chat_completions_stream_and_whole_agree() -> None:
    messages = [{"role": "user", "content": "say something"}]
    b = {"messages": messages, "max_tokens": 8, "temperature": 0}

    async def go() -> tuple[Any, Any]:
        async with served() as (client, _):
            whole = await completion(client, b, chat=True)
            streamed = await completion(client, {**b, "stream": True}, chat=True)
            return whole, streamed

    whole, streamed = run(go())
    want = offline([messages], [SamplingParams(max_tokens=8, temperature=0)])[0]  # type: ignore[list-item]
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert streamed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert stream_text(streamed, chat=True) == want


def test_stop_strings_cut_the_text_and_never_stream_part_of_one(tmp_path: Path) -> None:
    base = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0}
    full = offline([base["prompt"]], [SamplingParams(max_tokens=24, temperature=0)])[0]
    text = full.replace("\ufffd", "")
    stop = next(text[i : i + 2] for i in range(6, len(text) - 2) if text[i : i + 2].isprintable())
    want = full[: full.index(stop)]

    async def go() -> tuple[Any, Any]:
        async with served(tmp_path / "t.trace") as (client, _):
            whole = await completion(client, {**base, "stop": [stop, "never-there"]})
            streamed = await completion(client, {**base, "stop": stop, "stream": True})
            return whole, streamed

    whole, streamed = run(go())
    assert whole["choices"][0]["text"] == want
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert stream_text(streamed, chat=False) == want
    for e in streamed[:-1]:  # no chunk ends with the start of the stop string
        assert not e["choices"][0]["text"].endswith(stop[0]) or stop[0] in want[-1:]
    # vLLM ends a stop-string match by aborting the request in the engine: so do we.
    with TraceReader(tmp_path / "t.trace") as reader:
        finishes = [f.status for s in reader.steps() for f in s.finishes]
    assert finishes == [Status.FINISHED_ABORTED] * 2


BAD = [
    ({"prompt": "hi", "bogus": 1}, 400, "bogus", "unknown field"),
    ({"prompt": "hi", "n": 65}, 400, "n", "less than or equal to 64"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", ""),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10_000}, 400, None, "maximum context length"),
    ({"prompt": "x" * 2000}, 400, None, "maximum context length"),
    ({"prompt": [1, 2, 10**9]}, 400, None, "not a token id"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"max_tokens": 3}, 400, "prompt", "prompt"),
    ({"prompt": "hi", "priority": 1}, 400, None, "--scheduling-policy priority"),
]


def test_bad_requests_get_openai_errors_and_the_others_complete(tmp_path: Path) -> None:
    kept: list[int] = []

    async def go() -> tuple[list[httpx.Response], Any, Any, str]:
        async with served(tmp_path / "t.trace") as (client, loop):
            good = completion(client, body(1, "hello", stream=True))
            bad = [client.post("/v1/completions", json=b) for b, *_ in BAD]
            bad.append(client.post("/v1/completions", content=b'{"prompt": '))
            bad.append(client.post("/v1/completions", content=b"[1, 2]"))
            bad.append(client.post("/v1/chat/completions", json={"messages": []}))
            *responses, ok = await asyncio.gather(*bad, good)
            whole = await completion(client, body(3, "hello", stream=False))
            kept.append(len(loop.engine._outputs))
            return responses, ok, whole, (await client.get("/metrics")).text

    responses, ok, whole, metrics = run(go())
    expected = [(s, p, m) for _, s, p, m in BAD] + [
        (400, None, "not valid JSON"),
        (400, None, "JSON object"),
        (400, "messages", "messages"),
    ]
    for r, (status, param, fragment) in zip(responses, expected):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and fragment in err["message"]
    assert ok[-1] == "[DONE]" and whole["usage"]["completion_tokens"] == 9
    assert kept == [0]  # a server forgets what it has served (it runs for days)
    assert metric(metrics, "vllm:request_success_total", finished_reason="length") == 2
    with TraceReader(tmp_path / "t.trace") as reader:
        clients = [e.record for e in reader.entries() if isinstance(e.record, Client)]
    statuses = sorted(c.status for c in clients)
    assert statuses == sorted([200, 200, *(s for s, _, _ in expected)])
    assert all(c.message for c in clients if c.status >= 400)


def test_api_key_guards_v1_but_not_health_or_metrics() -> None:
    async def go() -> dict[str, int]:
        async with served(api_key="s3cret") as (client, _):
            key = {"Authorization": "Bearer s3cret"}
            wrong = {"Authorization": "Bearer nope"}
            got = {
                "models": (await client.get("/v1/models")).status_code,
                "models-wrong": (await client.get("/v1/models", headers=wrong)).status_code,
                "models-key": (await client.get("/v1/models", headers=key)).status_code,
                "complete": (
                    await client.post("/v1/completions", json={"prompt": "hi"})
                ).status_code,
                "stream": (await client.get("/v1/schedtop/stream")).status_code,
                "incident": (await client.post("/v1/schedtop/incident")).status_code,
                "health": (await client.get("/health")).status_code,
                "metrics": (await client.get("/metrics")).status_code,
                "version": (await client.get("/version")).status_code,
            }
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            got["body-type"] = r.json()["error"]["type"] == "authentication_error"
            return got

    got = run(go())
    assert got == {
        "models": 401,
        "models-wrong": 401,
        "models-key": 200,
        "complete": 401,
        "stream": 401,
        "incident": 401,
        "health": 200,
        "metrics": 200,
        "version": 200,
        "body-type": True,
    }


def test_a_full_waiting_queue_answers_503_and_the_admitted_finish() -> None:
    async def go() -> list[httpx.Response]:
        async with served(max_waiting=1, max_num_seqs=1) as (client, _):
            b = {"prompt": "hello", "max_tokens": 12, "temperature": 0}
            return list(
                await asyncio.gather(*(client.post("/v1/completions", json=b) for _ in range(6)))
            )

    responses = run(go())
    codes = [r.status_code for r in responses]
    assert 503 in codes and 200 in codes and set(codes) == {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert "--max-waiting 1" in r.json()["error"]["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 12


def test_priorities_order_the_waiting_queue_under_the_priority_policy(tmp_path: Path) -> None:
    """With one running slot, the lower priority value is admitted first among waiters."""

    async def go() -> None:
        async with served(tmp_path / "t.trace", max_num_seqs=1, policy="priority") as (c, _):
            long = {"prompt": "a", "max_tokens": 200, "ignore_eos": True}
            first = asyncio.ensure_future(completion(c, long))
            # Running before the others arrive (not a sleep: on a busy machine it may not be).
            while metric((await c.get("/metrics")).text, "vllm:num_requests_running") < 1:
                assert not first.done(), "the long request ended before it was seen running"
                await asyncio.sleep(0.01)
            later = [
                completion(c, {"prompt": f"p{p}", "max_tokens": 2, "priority": p})
                for p in (5, 1, 3)
            ]
            await asyncio.gather(first, *later)

    run(go())
    with TraceReader(tmp_path / "t.trace") as reader:
        names = {a.ref: a.priority for s in reader.steps() for a in s.arrivals}
        admitted = [names[a.ref] for s in reader.steps() for a in s.admissions]
    assert admitted[0] == 0 and admitted[1:] == sorted(admitted[1:])


def test_models_and_version() -> None:
    async def go() -> tuple[Any, Any]:
        async with served() as (client, _):
            return (await client.get("/v1/models")).json(), (await client.get("/version")).json()

    models, version = run(go())
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
    assert "version" in version


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="model_name"):
        ServeSettings("", 10)
    with pytest.raises(ValueError, match="api_key"):
        ServeSettings("m", 10, api_key="")
    with pytest.raises(ValueError, match="max_waiting"):
        EngineLoop(tiny_engine(MODEL), max_waiting=-1)


def test_trace_steps_are_not_disturbed_by_client_records(tmp_path: Path) -> None:
    """Readers that only want steps still get every step in order."""

    async def go() -> None:
        async with served(tmp_path / "t.trace") as (client, _):
            for i in range(3):
                await completion(client, body(i, "abc", stream=bool(i % 2)))
            await client.post("/v1/completions", json={"prompt": "abc", "bogus": True})

    run(go())
    with TraceReader(tmp_path / "t.trace") as reader:
        steps = [s.step for s in reader.steps()]
        kinds = [type(e.record).__name__ for e in reader.entries()]
        assert reader.closed_cleanly
    assert steps == list(range(len(steps)))
    assert kinds.count("Client") == 4 and kinds.count("Step") == len(steps)
    assert json.dumps(kinds)  # nothing unknown


def test_the_tui_header_shows_http_counts_and_a_followed_requests_client_timings(
    tmp_path: Path,
) -> None:
    from tui.commands import FollowRequest, GotoEdge
    from tui.launch import open_session

    async def go() -> str:
        async with served(tmp_path / "t.trace") as (client, _):
            r = await client.post("/v1/completions", json={**body(1, "abc", True)})
            rid = r.headers["x-request-id"]
            await completion(client, body(2, "abc", stream=False))
            await client.post("/v1/completions", json={"prompt": "abc", "bogus": True})
            return rid

    rid = run(go())
    session = open_session(tmp_path / "t.trace", live=False)
    try:
        assert session.frame().header.http == ""  # before the first response ended
        session.handle(GotoEdge(end=True))
        session.handle(FollowRequest(rid))
        header = session.frame().header
    finally:
        session.close()
    assert header.http == "HTTP 2 ok · 1 4xx"
    assert header.client.startswith("client: queue ") and "HTTP 200" in header.client


def test_a_stopped_engine_answers_503_instead_of_hanging() -> None:
    async def go() -> tuple[int, int, str]:
        async with served() as (client, loop):
            await asyncio.to_thread(loop.stop)
            r = await client.post("/v1/completions", json={"prompt": "hi"})
            health = (await client.get("/health")).status_code
            return r.status_code, health, r.json()["error"]["message"]

    status, health, message = run(go())
    assert (status, health) == (503, 503) and "engine is not running" in message


def test_a_prompt_the_kv_pool_can_never_hold_is_a_400_that_the_trace_shows(
    tmp_path: Path,
) -> None:
    small = RunnerOptions(num_gpu_blocks_override=4)  # 3 usable blocks of 16 tokens

    async def go() -> httpx.Response:
        async with served(tmp_path / "t.trace", options=small) as (client, _):
            return await client.post("/v1/completions", json={"prompt": "x" * 60})

    r = run(go())
    assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]
    with TraceReader(tmp_path / "t.trace") as reader:
        entries = [e.record for e in reader.entries()]
    (client,) = [c for c in entries if isinstance(c, Client)]
    finishes = [f for s in entries if isinstance(s, Step) for f in s.finishes]
    assert client.request_id and client.status == 400
    assert [f.status for f in finishes] == [Status.FINISHED_ERROR]


def test_a_clients_user_is_recorded_as_its_requests_tenant(tmp_path: Path) -> None:
    """`--group-by tenant` on a server's trace: the OpenAI `user` field, bounded."""

    async def go() -> None:
        async with served(tmp_path / "t.trace") as (client, _):
            await completion(client, {"prompt": "ab", "max_tokens": 2, "user": "team-a"})
            await completion(client, {"prompt": "ab", "max_tokens": 2, "user": "x" * 1000})
            await completion(client, {"prompt": "ab", "max_tokens": 2})

    run(go())
    with TraceReader(tmp_path / "t.trace") as reader:
        tenants = [a.tenant for s in reader.steps() for a in s.arrivals]
    assert tenants == ["team-a", "x" * 256, None]
