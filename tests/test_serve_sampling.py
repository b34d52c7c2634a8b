"""The sampling fields `schedtop serve` implements (issue 26 item 1), in process on the
tiny model: logprobs in OpenAI's shapes for both endpoints, whole and streamed; n > 1 as
vLLM's parallel sampling (n engine requests that share the prompt's blocks through the
prefix cache, visible as prefix hits in the trace); echo; penalties, min_p and logit_bias
reaching the sampler (what they do to tokens: tests/test_sampler_processing.py)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from engine.records import Client
from recorder.reader import TraceReader
from replays.clients import ClientLog, server_stats
from tests.serve_support import sse_events
from tests.test_serve_app import run, served

LONG = "the prefix that every choice shares, longer than two blocks of sixteen"
CHAT = [{"role": "user", "content": "say something"}]


async def post(client: httpx.AsyncClient, path: str, b: dict[str, Any]) -> Any:
    r = await client.post(path, json=b)
    assert r.status_code == 200, r.text
    if b.get("stream"):
        events = list(sse_events(r.text.splitlines()))
        assert events[-1] == "[DONE]"
        return events[:-1]
    return r.json()


def test_completion_logprobs_whole_and_streamed() -> None:
    b = {"prompt": "the quick brown fox", "max_tokens": 6, "temperature": 0, "logprobs": 2}

    async def go() -> tuple[Any, Any]:
        async with served() as (client, _):
            whole = await post(client, "/v1/completions", b)
            streamed = await post(client, "/v1/completions", {**b, "stream": True})
            return whole, streamed

    whole, streamed = run(go())
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == whole["usage"]["completion_tokens"] == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(6)]
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and tok in top and top[tok] == value
        assert 1 <= len(top) <= 3  # the two most likely and the sampled token (some may
        # spell the same: the tiny model's random tokens are often pieces of characters)
    tokens, values = [], []
    for e in streamed:
        for c in e["choices"]:
            if c["logprobs"]:
                tokens += c["logprobs"]["tokens"]
                values += c["logprobs"]["token_logprobs"]
    assert tokens == lp["tokens"]
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(values, lp["token_logprobs"]))


def test_chat_logprobs_whole_and_streamed() -> None:
    b = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}

    async def go() -> tuple[Any, Any, httpx.Response, Any]:
        async with served() as (client, _):
            whole = await post(client, "/v1/chat/completions", b)
            streamed = await post(client, "/v1/chat/completions", {**b, "stream": True})
            bad = await client.post(
                "/v1/chat/completions", json={"messages": CHAT, "top_logprobs": 2}
            )
            none = await post(
                client, "/v1/chat/completions", {**b, "logprobs": False, "top_logprobs": 0}
            )
            return whole, streamed, bad, none

    whole, streamed, bad, none = run(go())
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy
    got = [
        e
        for ev in streamed
        for c in ev["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    assert [e["token"] for e in got] == [e["token"] for e in content]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
    assert none["choices"][0]["logprobs"] is None


def test_n_choices_share_the_prompt_through_the_prefix_cache(tmp_path: Path) -> None:
    trace = tmp_path / "n.trace"
    b = {"prompt": LONG, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 11}

    async def go() -> tuple[Any, Any, Any]:
        async with served(trace) as (client, _):
            r = await client.post("/v1/completions", json=b, headers={"X-Request-Id": "par"})
            assert r.status_code == 200, r.text
            streamed = await post(client, "/v1/chat/completions",
                                  {"messages": CHAT, "max_tokens": 4, "n": 2, "stream": True,
                                   "stream_options": {"include_usage": True}})  # fmt: skip
            again = await post(client, "/v1/completions", b)
            return r.json(), streamed, again

    whole, streamed, again = run(go())
    assert whole["id"] == "cmpl-par"
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in whole["choices"]]
    assert len(set(texts)) > 1  # each child samples on its own (seed + index, as vLLM)
    assert texts == [c["text"] for c in again["choices"]]  # seeded: reproducible
    assert whole["usage"]["completion_tokens"] == 24
    per_index = Counter(c["index"] for e in streamed for c in e["choices"] if c.get("delta"))
    assert set(per_index) == {0, 1}
    assert streamed[-1]["usage"]["completion_tokens"] == 8
    with TraceReader(trace) as reader:
        steps = list(reader.steps())
    names = {a.ref: a.request_id for s in steps for a in s.arrivals}
    assert [n for n in names.values() if n.startswith("cmpl-par")] == [
        "cmpl-par-0", "cmpl-par-1", "cmpl-par-2"
    ]  # fmt: skip
    cached = {names[a.ref]: a.cached_tokens for s in steps for a in s.admissions}
    assert cached["cmpl-par-0"] == 0
    assert cached["cmpl-par-1"] >= 32 and cached["cmpl-par-2"] >= 32  # the shared prefix


def test_n_choices_each_have_a_client_record_under_the_parent(tmp_path: Path) -> None:
    """n > 1: each choice is its own engine request, so the trace has a CLIENT record per
    choice (its own TTFT, ITL, tokens: what vLLM's per-request metrics count), under the
    HTTP request's id as parent_id; `stats` counts them as one HTTP response."""
    trace = tmp_path / "n.trace"
    whole = {"prompt": LONG, "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 5,
             "ignore_eos": True}  # fmt: skip
    streamed = {**whole, "n": 2, "max_tokens": 4, "stream": True}

    async def go() -> None:
        async with served(trace) as (client, _):
            r = await client.post("/v1/completions", json=whole, headers={"X-Request-Id": "w"})
            assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json=streamed, headers={"X-Request-Id": "s"})
            assert r.status_code == 200, r.text
            r = await client.post("/v1/completions", json={"prompt": "one", "max_tokens": 2})
            assert r.status_code == 200, r.text

    run(go())
    with TraceReader(trace) as reader:
        records = [e.record for e in reader.entries() if isinstance(e.record, Client)]
    by_id = {c.request_id: c for c in records}
    for parent, n, tokens in (("cmpl-w", 3, 6), ("cmpl-s", 2, 4)):
        kids = [by_id[f"{parent}-{i}"] for i in range(n)]
        assert parent not in by_id  # the parent is no engine request
        assert {c.parent_id for c in kids} == {parent}
        for c in kids:
            assert c.completion_tokens == tokens and c.finish_reason == "length"
            assert c.status == 200 and c.ttft_ns is not None and c.queue_ns is not None
            assert c.ttft_ns <= c.e2e_ns
        if parent == "cmpl-s":  # streamed: each choice's own gaps, at most one per token
            # after the first (the tiny model's tokens are often pieces of a character,
            # which go out with the next)
            assert all(len(c.itl_ns) <= tokens - 1 for c in kids)
    (single,) = [c for c in records if not c.parent_id]
    stats = server_stats(records)
    assert stats is not None
    assert stats.http_requests == 3 and stats.statuses == {200: 3}
    assert ClientLog(trace).summary(10**9) == ""  # not read yet
    log = ClientLog(trace)
    log.refresh()
    assert log.summary(10**9) == "HTTP 3 ok"
    assert "TTFT" in log.timings("cmpl-w-1", 10**9)  # a choice's own timings, by its id
    assert single.request_id and single.parent_id == ""


def test_echo_prepends_the_prompt() -> None:
    b = {"prompt": "echo this", "max_tokens": 4, "temperature": 0}

    async def go() -> list[Any]:
        async with served() as (client, _):
            plain = await post(client, "/v1/completions", b)
            echoed = await post(client, "/v1/completions", {**b, "echo": True})
            streamed = await post(client, "/v1/completions", {**b, "echo": True, "stream": True})
            ids = await post(client, "/v1/completions", {**b, "prompt": [101, 102], "echo": True})
            refused = await client.post("/v1/completions", json={**b, "echo": True, "logprobs": 1})
            return [plain, echoed, streamed, ids, refused]

    plain, echoed, streamed, ids, refused = run(go())
    out = plain["choices"][0]["text"]
    assert echoed["choices"][0]["text"] == "echo this" + out
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == "echo this" + out
    assert ids["choices"][0]["text"].startswith(
        "bc"
    )  # ids 101, 102: the bytes b, c (3 control tokens first)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"


def test_penalties_bias_and_min_p_reach_the_sampler() -> None:
    base = {"prompt": "the quick brown fox", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}  # fmt: skip

    async def go() -> list[Any]:
        async with served() as (client, _):
            plain = await post(client, "/v1/completions", {**base, "logprobs": 0})
            token = plain["choices"][0]["logprobs"]["tokens"][0]
            forced = await post(client, "/v1/completions", {**base, "logit_bias": {"70": 100}})
            huge = await post(client, "/v1/completions", {**base, "logit_bias": {"70": 1e9}})
            freq = await post(client, "/v1/completions", {**base, "frequency_penalty": 2.0})
            minp = await post(client, "/v1/completions",
                              {**base, "temperature": 1.5, "min_p": 1.0})  # fmt: skip
            bad = await client.post("/v1/completions", json={**base, "logit_bias": {"x": 1}})
            vocab = await client.post("/v1/completions", json={**base, "logit_bias": {"99999": 1}})
            return [plain, token, forced, huge, freq, minp, bad, vocab]

    plain, _, forced, huge, freq, minp, bad, vocab = run(go())
    text = plain["choices"][0]["text"]
    assert forced["choices"][0]["text"] == huge["choices"][0]["text"]  # clamped to 100
    assert len(set(forced["choices"][0]["text"])) == 1
    # what the penalty does to repeats: tests/test_sampler_processing.py; here, that it
    # reaches the sampler at all
    assert freq["choices"][0]["text"] != text
    assert minp["choices"][0]["text"] == text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "logit_bias"
