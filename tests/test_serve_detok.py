"""Incremental detokenization and stop strings, on the tiny byte-level tokenizer."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schedtop_server.detok import IncrementalDetokenizer, StopStrings
from tests.model_support import tiny_tokenizer

TOK = tiny_tokenizer()


def test_a_character_split_across_tokens_waits_for_its_last_byte() -> None:
    text = "café 😀 ok"
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK.decode)
    deltas = [d.push([t]) for t in ids]
    assert "".join(deltas) + d.finish() == TOK.decode(ids)
    assert not any("\ufffd" in x for x in deltas)
    assert deltas.count("") >= 4  # the emoji's first three bytes and é's first


@given(st.text(min_size=0, max_size=40), st.integers(1, 4))
def test_deltas_add_up_to_the_whole_decode(text: str, chunk: int) -> None:
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK.decode)
    out = "".join(d.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + d.finish()
    assert out == TOK.decode(ids)


def test_stop_strings_are_cut_and_never_streamed_in_part() -> None:
    s = StopStrings(["STOP", "\n\n"])
    sent = [s.feed(x) for x in ["Hello S", "T", "O", "P and more"]]
    assert "".join(sent) == "Hello " and s.matched == "STOP"
    assert s.feed("more") == ""  # nothing after a match


def test_held_text_that_never_becomes_a_stop_string_is_released() -> None:
    s = StopStrings(["STOP"])
    # The last len("STOP") - 1 characters wait (as vLLM holds them), the rest goes out.
    assert s.feed("abc ST") == "abc"
    assert s.feed("AR") == " S"
    assert s.feed("", final=True) == "TAR" and s.matched is None


def test_the_earliest_of_several_stop_strings_wins() -> None:
    s = StopStrings(["world", "lo w"])
    assert s.feed("hello world") == "hel" and s.matched == "lo w"


@given(st.text(alphabet="abcS TOP", max_size=30), st.integers(1, 5))
def test_streaming_gives_what_one_cut_of_the_whole_text_gives(text: str, chunk: int) -> None:
    s = StopStrings(["STOP", "aa"])
    out = "".join(s.feed(text[i : i + chunk]) for i in range(0, len(text), chunk))
    out += s.feed("", final=True)
    cuts = [i for i in (text.find("STOP"), text.find("aa")) if i >= 0]
    assert out == (text[: min(cuts)] if cuts else text)
