"""vLLM's request schema on `schedtop serve` (issue 26 item 1), and requests that must not
stop the engine (item 3), in process on the tiny model.

Every field vLLM 0.33 defines is accepted at its default value; one that this server does
not implement is refused with an OpenAI-shaped 400 naming it only when its value would
change the output. Exceptions while handling one request fail that request alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from recorder.reader import TraceReader
from schedtop_server.app import DEFAULT_MAX_BODY_BYTES
from schedtop_server.detok import IncrementalDetokenizer
from schedtop_server.loop import EngineLoop
from schedtop_server.protocol import NEUTRAL_CHAT, NEUTRAL_COMPLETION
from tests.serve_support import sse_events, stream_text
from tests.test_serve_app import run, served

CHAT = [{"role": "user", "content": "say something"}]


async def post(client: httpx.AsyncClient, path: str, b: dict[str, Any], **kw: Any) -> Any:
    r = await client.post(path, json=b, **kw)
    if b.get("stream") and r.status_code == 200:
        return r, list(sse_events(r.text.splitlines()))
    return r, r.json()


def neutral_values(table: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Every unimplemented field at a value that changes nothing (null where the table
    lists none, as vLLM's defaults mostly are)."""
    out: dict[str, Any] = {}
    for key, allowed in table.items():
        out[key] = allowed[0] if allowed and allowed[0] != "<any>" else None
    return out


def test_every_neutral_field_at_its_default_gives_the_same_output() -> None:
    base = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}

    async def go() -> list[Any]:
        async with served() as (client, _):
            plain = await post(client, "/v1/completions", base)
            full = {**base, **neutral_values(NEUTRAL_COMPLETION), "stop": [],
                    "stop_token_ids": [], "min_tokens": 0, "seed": None, "user": "u1",
                    "top_k": -1, "top_p": None, "skip_special_tokens": None, "n": 1,
                    "include_stop_str_in_output": False, "ignore_eos": False, "priority": 0,
                    "stream": False, "stream_options": None, "request_id": "abc"}  # fmt: skip
            everything = await post(client, "/v1/completions", full)
            chat = {"messages": CHAT, "max_completion_tokens": 8, "temperature": 0}
            chat_plain = await post(client, "/v1/chat/completions", chat)
            chat_full = {**chat, **neutral_values(NEUTRAL_CHAT), "max_tokens": None}
            chat_everything = await post(client, "/v1/chat/completions", chat_full)
            return [plain, everything, chat_plain, chat_everything]

    (r1, a), (r2, b), (r3, c), (r4, d) = run(go())
    assert (r1.status_code, r2.status_code, r3.status_code, r4.status_code) == (200,) * 4, (
        b,
        d,
    )
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert c["choices"][0]["message"] == d["choices"][0]["message"]
    assert c["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize(
    ("chat", "field", "value"),
    [
        (False, "suffix", "x"),
        (False, "best_of", 2),
        (True, "echo", True),
        (True, "add_generation_prompt", False),
        (True, "tools", [{"type": "function", "function": {"name": "f"}}]),
        (True, "chat_template", "{{ messages }}"),
    ],
)
def test_unimplemented_fields_that_would_change_the_output_are_refused(
    chat: bool, field: str, value: Any
) -> None:
    b: dict[str, Any] = {"messages": CHAT} if chat else {"prompt": "hi"}
    b[field] = value
    path = "/v1/chat/completions" if chat else "/v1/completions"

    async def go() -> tuple[httpx.Response, httpx.Response]:
        async with served() as (client, _):
            refused = await client.post(path, json=b)
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return refused, ok

    refused, ok = run(go())
    assert refused.status_code == 400
    err = refused.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert f"{field}=" in err["message"] and "not supported" in err["message"]
    assert ok.status_code == 200


def test_content_parts_are_text_and_media_parts_are_refused() -> None:
    parts = [{"type": "text", "text": "say"}, {"type": "text", "text": "something"}]
    joined = [{"role": "user", "content": "say\nsomething"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}

    async def go() -> list[Any]:
        async with served() as (client, _):
            got = []
            for messages in (
                [{"role": "user", "content": parts}],
                joined,
                [{"role": "user", "content": [parts[0], image]}],
                [{"role": "user", "content": [{"type": "input_audio"}]}],
            ):
                b = {"messages": messages, "max_tokens": 6, "temperature": 0}
                got.append(await post(client, "/v1/chat/completions", b))
            return got

    (r1, a), (r2, b), (r3, c), (r4, d) = run(go())
    assert r1.status_code == r2.status_code == 200
    assert a["choices"][0]["message"] == b["choices"][0]["message"]  # joined by newlines
    assert r3.status_code == r4.status_code == 400
    assert c["error"]["param"] == "messages.0.content.1"
    assert "'image_url' content parts are not supported" in c["error"]["message"]
    assert "text-only" in d["error"]["message"]


def test_stream_options_usage_on_every_chunk_and_max_completion_tokens() -> None:
    async def go() -> list[Any]:
        async with served() as (client, _):
            usage = {"include_usage": True, "continuous_usage_stats": True}
            b = {"messages": CHAT, "max_completion_tokens": 5, "temperature": 0,
                 "ignore_eos": True, "stream": True, "stream_options": usage}  # fmt: skip
            last_only = {"include_usage": True, "continuous_usage_stats": None}
            c = {"prompt": "hello", "max_tokens": 5, "stream": True, "ignore_eos": True,
                 "stream_options": last_only}  # fmt: skip
            return [await post(client, "/v1/chat/completions", b),
                    await post(client, "/v1/completions", c)]  # fmt: skip

    (r1, chat), (r2, plain) = run(go())
    assert r1.status_code == r2.status_code == 200
    chunks = [e for e in chat if e != "[DONE]"]
    assert all("usage" in e for e in chunks)  # continuous: every chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts)
    plain_chunks = [e for e in plain if e != "[DONE]"]
    assert ["usage" in e for e in plain_chunks] == [False] * (len(plain_chunks) - 1) + [True]


def test_client_ids_name_the_request_in_the_trace(tmp_path: Path) -> None:
    async def go() -> list[httpx.Response]:
        async with served(tmp_path / "t.trace") as (client, _):
            b = {"prompt": "hi", "max_tokens": 2}
            return [
                await client.post("/v1/completions", json=b, headers={"X-Request-Id": "job-7"}),
                await client.post("/v1/completions", json={**b, "request_id": "batch-1"}),
                await client.post("/v1/completions", json=b, headers={"X-Request-Id": "\x01"}),
            ]

    header, field, bad = run(go())
    assert header.json()["id"] == "cmpl-job-7" and field.json()["id"] == "cmpl-batch-1"
    assert bad.status_code == 400
    with TraceReader(tmp_path / "t.trace") as reader:
        arrivals = [a.request_id for s in reader.steps() for a in s.arrivals]
    assert arrivals == ["cmpl-job-7", "cmpl-batch-1"]


def test_stop_token_ids_and_include_stop_str() -> None:
    async def go() -> list[Any]:
        async with served() as (client, _):
            base = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
            free = await post(client, "/v1/completions", {**base, "return_token_ids": None})
            text = free[1]["choices"][0]["text"]
            stop = text[3:5]
            kept = await post(
                client,
                "/v1/completions",
                {**base, "stop": stop, "include_stop_str_in_output": True},
            )
            return [text, stop, kept[1]]

    text, stop, kept = run(go())
    assert kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]


# -- nothing a client sends stops the engine -------------------------------------------------


def test_a_lone_surrogate_is_a_400_and_the_engine_serves_on() -> None:
    async def go() -> list[httpx.Response]:
        async with served() as (client, loop):
            raw = b'{"prompt": "abc \\ud800 def", "max_tokens": 3}'
            bad = await client.post(
                "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
            )
            chat = await client.post(
                "/v1/chat/completions",
                content=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
            )
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            health = await client.get("/health")
            assert loop.alive
            return [bad, chat, ok, health]

    bad, chat, ok, health = run(go())
    assert bad.status_code == chat.status_code == 400, (bad.text, chat.text)
    assert "cannot be tokenized" in bad.json()["error"]["message"]
    assert ok.status_code == health.status_code == 200


def fault(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected fault")


@pytest.mark.parametrize("stage", ["tokenize", "add_request", "detokenize", "metrics", "client"])
def test_faults_at_each_stage_fail_one_request_not_the_engine(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault injected at one stage of one request: that request gets an error (or, for
    side tasks such as metrics and the trace's client records, nothing at all), and the
    next request is served."""

    def arm(loop: EngineLoop) -> None:
        engine = loop.engine
        if stage == "tokenize":
            monkeypatch.setattr(engine, "tokenize", fault)
        elif stage == "add_request":
            monkeypatch.setattr(engine, "add_request", fault)
        elif stage == "detokenize":
            monkeypatch.setattr(IncrementalDetokenizer, "push", fault)
        elif stage == "metrics":
            assert loop.metrics is not None
            monkeypatch.setattr(loop.metrics, "observe_finish", fault)
            monkeypatch.setattr(loop.metrics, "observe_step", fault)
        else:
            monkeypatch.setattr(engine, "report_client", fault)

    async def go() -> tuple[list[Any], int]:
        async with served() as (client, loop):
            arm(loop)
            b = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
            faulty = [
                await post(client, "/v1/completions", b),
                await post(client, "/v1/completions", {**b, "stream": True}),
            ]
            monkeypatch.undo()
            ok = await post(client, "/v1/completions", b)
            assert loop.alive, loop.stats.errors
            return [*faulty, ok], loop.stats.request_faults

    results, faults = run(go())
    (r1, whole), (r2, streamed), (r3, ok) = results
    assert faults >= (0 if stage == "tokenize" else 1)  # a tokenizer's error is a refusal
    assert r3.status_code == 200 and ok["usage"]["completion_tokens"] == 4
    if stage in ("metrics", "client"):  # side tasks: the requests themselves are fine
        assert r1.status_code == r2.status_code == 200
        return
    if stage == "detokenize":  # accepted, then failed: a 500, and an error event in the stream
        assert r1.status_code == 500 and "injected fault" in whole["error"]["message"]
        assert r2.status_code == 200
        assert streamed[-1] == "[DONE]" and "error" in streamed[-2]
        return
    status = 400 if stage == "tokenize" else 500
    assert r1.status_code == r2.status_code == status, (whole, streamed)
    assert "injected fault" in whole["error"]["message"]


def test_when_the_engine_dies_health_fails_and_requests_get_500s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dead: list[str] = []

    async def go() -> list[Any]:
        async with served() as (client, loop):
            loop.on_dead = dead.append
            monkeypatch.setattr(loop.engine, "step", fault)
            r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
            for _ in range(100):  # the thread ends right after answering: bounded wait
                if not loop.alive:
                    break
                await asyncio.sleep(0.05)
            after = await client.post("/v1/completions", json={"prompt": "hi"})
            return [r, (await client.get("/health")).status_code, after]

    r, health, after = run(go())
    assert r.status_code == 500 and "the engine died" in r.json()["error"]["message"]
    assert health == 503 and after.status_code == 503
    assert dead == ["RuntimeError: injected fault"]


def test_streams_mid_flight_get_an_error_event_when_the_engine_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def go() -> list[Any]:
        async with served() as (client, loop):
            calls = {"n": 0}
            step = loop.engine.step

            def flaky() -> Any:
                calls["n"] += 1
                if calls["n"] > 3:
                    raise RuntimeError("injected fault")
                return step()

            monkeypatch.setattr(loop.engine, "step", flaky)
            b = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
            return list(await post(client, "/v1/completions", b))

    r, events = run(go())
    assert r.status_code == 200
    assert events[-1] == "[DONE]" and "the engine died" in events[-2]["error"]["message"]
    assert stream_text(events[:-2], chat=False)  # some text came before


# -- admission: body size, tokenizing off the engine thread ----------------------------------


def test_bodies_over_the_limit_get_413_declared_or_streamed() -> None:
    big = b'{"prompt": "' + b"a" * (DEFAULT_MAX_BODY_BYTES + 10) + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    async def go() -> list[httpx.Response]:
        async with served() as (client, loop):
            declared = await client.post("/v1/completions", content=big)
            streamed = await client.post("/v1/completions", content=chunks())
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert loop.stats.added == 1  # nothing too large reached the engine
            return [declared, streamed, ok]

    declared, streamed, ok = run(go())
    for r in (declared, streamed):
        assert r.status_code == 413
        assert "larger than this server's limit" in r.json()["error"]["message"]
    assert ok.status_code == 200


def test_prompts_are_tokenized_off_the_engine_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Text and chat templates are tokenized in a worker; the engine thread only checks
    the ids it is handed (add_request's range check)."""
    calls: list[tuple[str, bool]] = []  # (thread, the prompt was ids already)

    async def go() -> list[int]:
        async with served() as (client, loop):
            tokenize = loop.engine.tokenize

            def spy(prompt: Any) -> list[int]:
                ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
                calls.append((threading.current_thread().name, ids))
                return tokenize(prompt)

            monkeypatch.setattr(loop.engine, "tokenize", spy)
            chat = {"messages": CHAT, "max_tokens": 2}
            got = [
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                await client.post("/v1/chat/completions", json=chat),
            ]
            return [r.status_code for r in got]

    assert run(go()) == [200, 200]
    text = [thread for thread, ids in calls if not ids]
    assert len(text) == 2 and "schedtop-engine" not in text, calls


def test_odd_bodies_get_openai_errors_not_plain_text() -> None:
    async def go() -> list[httpx.Response]:
        async with served() as (client, _):
            deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            return [
                await client.post("/v1/completions", content=deep),
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2**40}),
            ]

    for r in run(go()):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_and_detokenize_as_vllm_has_them() -> None:
    async def go() -> list[httpx.Response]:
        async with served(api_key="k") as (client, loop):
            tokenize, detok = "/tokenize", "/detokenize"
            text = await client.post(tokenize, json={"prompt": "hello there", "model": "tiny"})
            ids = text.json()["tokens"]
            return [
                text,
                await client.post(detok, json={"tokens": ids}),
                await client.post(tokenize, json={"messages": CHAT, "return_token_strs": True}),
                await client.post(tokenize, json={"prompt": "x", "model": "other"}),
                await client.post(detok, json={"tokens": [10**9]}),
                await client.post(tokenize, json={"prompt": "x", "messages": CHAT}),
            ]

    text, detok, chat, other, bad_id, both = run(go())
    assert text.status_code == 200, text.text  # open without the key, as in vLLM
    got = text.json()
    assert got["count"] == len(got["tokens"]) > 0 and got["max_model_len"] == 512
    assert detok.json() == {"prompt": "hello there"}
    assert chat.status_code == 200 and len(chat.json()["token_strs"]) == chat.json()["count"]
    assert other.status_code == 404
    assert bad_id.status_code == both.status_code == 400
