"""Issue 14, class 4: a hostile chat template (from a model file) fails the request with a
clear error within bounded time and memory: recursion, huge repetitions and powers,
nested loops that run for minutes, output that grows without end."""

from __future__ import annotations

import dataclasses
import time
import tracemalloc

import pytest

from engine.limits import MAX_TEMPLATE_S
from engine.model.errors import RequestError
from tests.model_support import tiny_tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "recursive macro": (
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "recursed too deeply",
    ),
    "huge repetition": ("{{ 'A' * 3000000000 }}", "exceeds"),
    "huge list repetition": ("{{ ([1] * 3000000000) | length }}", "exceeds"),
    "huge power": ("{{ 2 ** 100000000 }}", "too large"),
    "nested loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "took more than",
    ),
    "endless output": (
        "{% for i in range(100000) %}{{ 'A' * 100000 }}{% endfor %}",
        "exceeds",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_fail_the_request_in_bounded_time_and_memory(name: str) -> None:
    source, message = HOSTILE[name]
    tok = dataclasses.replace(tiny_tokenizer(), chat_template=source, _template=None)
    tracemalloc.start()
    start = time.monotonic()
    try:
        with pytest.raises(RequestError, match=message):
            tok.render_chat(MESSAGES)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # generous bounds (a loaded machine): the limits are 2 s and 32 Mi characters
    assert time.monotonic() - start < MAX_TEMPLATE_S + 30
    assert peak < 512 << 20


def test_a_normal_template_still_renders_and_the_tracer_is_removed() -> None:
    import sys

    tok = tiny_tokenizer()
    before = sys.gettrace()
    text = tok.render_chat(MESSAGES)
    assert "hi" in text and sys.gettrace() is before
