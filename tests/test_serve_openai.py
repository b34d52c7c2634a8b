"""The real `openai` Python client against `schedtop serve` (issue 26 item 2): chat and
completions, whole and streamed, the newer request fields it sends (content parts,
max_completion_tokens, stream_options), and its error type for what is refused. A real
server process on the tiny model, on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.model_support import write_tiny_gguf
from tests.serve_support import ServerProcess

KEY = "openai-test-key"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    base = tmp_path_factory.mktemp("serve-openai")
    model = write_tiny_gguf(base)
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--no-trace",
            "--api-key", KEY, "--max-body-size", "64KiB"]  # fmt: skip
    with ServerProcess(args) as proc:
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            yield c
        finally:
            c.close()


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_completions_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    model = model_of(client)
    whole = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=8, temperature=0
    )
    assert whole.object == "text_completion" and whole.usage is not None
    assert 1 <= whole.usage.completion_tokens <= 8
    stream = client.completions.create(
        model=model,
        prompt="the quick brown fox",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        parts += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == whole.choices[0].text
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_whole_and_streamed_with_content_parts(client: openai.OpenAI) -> None:
    model = model_of(client)
    text = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "say\nsomething"}],
        max_completion_tokens=6,
        temperature=0,
    )
    parts = client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "say"}, {"type": "text", "text": "something"}],
            }
        ],
        max_completion_tokens=6,
        temperature=0,
        seed=7,
        user="someone",
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logprobs=False,
        n=1,
    )
    assert text.choices[0].message.content == parts.choices[0].message.content
    assert text.usage is not None and text.usage.completion_tokens <= 6
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "say\nsomething"}],
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    streamed, usages = [], []
    for chunk in stream:
        streamed += [c.delta.content or "" for c in chunk.choices]
        usages.append(chunk.usage)
    assert "".join(streamed) == text.choices[0].message.content
    assert all(u is not None for u in usages)  # continuous usage: on every chunk


def test_refusals_are_openai_errors_that_name_the_field(client: openai.OpenAI) -> None:
    model = model_of(client)
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(
            model=model,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                    ],
                }
            ],
        )
    assert "text-only" in str(image.value)
    with pytest.raises(openai.BadRequestError) as suffix:
        client.completions.create(model=model, prompt="hi", suffix="there")
    assert isinstance(suffix.value.body, dict)
    assert suffix.value.body.get("param") == "suffix"
    # ...and the server goes on.
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_lone_surrogate_is_refused_and_serving_goes_on(client: openai.OpenAI) -> None:
    """The openai client cannot even encode one (UTF-8 has no surrogates), but JSON's
    escape can carry it: sent raw, it is a 400, and the server goes on."""
    raw = b'{"prompt": "abc \\ud800 def", "max_tokens": 2}'
    bad = httpx.post(
        f"{client.base_url}completions",
        content=raw,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    assert bad.status_code == 400 and "cannot be tokenized" in bad.json()["error"]["message"]
    ok = client.completions.create(model=model_of(client), prompt="abc def", max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens >= 1


def test_the_request_id_header_names_the_response(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=model_of(client),
        prompt="hi",
        max_tokens=2,
        extra_headers={"X-Request-Id": "client-42"},
    )
    assert r.id == "cmpl-client-42"


def test_a_body_over_max_body_size_is_a_413(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as big:
        client.completions.create(model=model_of(client), prompt="a" * 100_000, max_tokens=2)
    assert big.value.status_code == 413 and "65536 bytes" in str(big.value)


def test_logprobs_and_n_through_the_client(client: openai.OpenAI) -> None:
    model = model_of(client)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "say something"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content is not None and chat.usage is not None
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    comp = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=4, temperature=0, logprobs=1
    )
    lp = comp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    many = client.completions.create(
        model=model, prompt="the quick brown fox", max_tokens=4, n=3, seed=5
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage is not None and many.usage.completion_tokens == 12
    chats = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "say something"}],
        max_completion_tokens=3,
        n=2,
        seed=3,
        stream=True,
        logprobs=True,
    )
    seen: dict[int, int] = {}
    for chunk in chats:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                seen[c.index] = seen.get(c.index, 0) + len(c.logprobs.content)
    # one logprob per token of each choice (a choice may stop on EOS before 3 tokens)
    assert set(seen) == {0, 1} and all(1 <= k <= 3 for k in seen.values())
