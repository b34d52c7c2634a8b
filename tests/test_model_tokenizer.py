"""The default model's tokenizer, built from GGUF metadata, against the one Hugging Face
transformers builds from the same file, and the chat template against its rendering."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from engine.model.loader import default_model_path
from tests.model_support import default_model, needs_default_model

pytestmark = [pytest.mark.slow, pytest.mark.model, needs_default_model]

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "I have 3 apples and 12 oranges; 2024-05-17 at 10:30.",
    "Ünïcödé text: café, naïve, 東京, emoji 🙂 and математика.",
    "def f(x):\n    return x ** 2  # square\n\n\tTabbed line\n",
    "Special tokens stay whole: <|im_start|>user\nhi<|im_end|>",
    "   leading spaces, trailing spaces   ",
    "",
]


@functools.cache
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(text: str) -> None:
    ours = default_model().tokenizer
    want = hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text) == want
    assert ours.decode(want, skip_special_tokens=False) == text


def test_special_tokens_and_ids() -> None:
    tok = default_model().tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 2, 0]) == ""  # control tokens are skipped when decoding


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ],
    ],
)
def test_chat_template_matches_transformers(messages: list[dict[str, str]]) -> None:
    ours = default_model().tokenizer
    want = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == want
    assert ours.apply_chat_template(messages)[0] == 1
    if messages[0]["role"] != "system":
        assert "You are a helpful AI assistant named SmolLM" in want
