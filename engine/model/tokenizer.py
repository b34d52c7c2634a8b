"""Text in and out: a `tokenizers` byte-level BPE built from GGUF metadata or loaded from a
tokenizer.json, plus the model's chat template (rendered in a Jinja sandbox, because a
template is code that came with a downloaded file)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.limits import MAX_TEMPLATE_CHARS, MAX_TEMPLATE_S
from engine.model.errors import ModelError, RequestError

# llama.cpp's pre-tokenizer names and the splits they stand for. The GPT-2 split is the
# ByteLevel pre-tokenizer's own regex; the others are explicit patterns before it.
_GPT2_NAMES = ("default", "gpt-2", "gpt2")
_DIGIT_FIRST_NAMES = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva")
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_NAMES = {"llama3": _LLAMA3_PATTERN, "llama-bpe": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}

TOKEN_TYPE_CONTROL = 3  # llama.cpp's token types: control tokens are special
TOKEN_TYPE_USER_DEFINED = 4  # added tokens matched whole, but not special


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer as a GGUF file stores it (tokenizer.ggml.*)."""

    model: str  # "gpt2" = byte-level BPE (the only kind supported)
    pre: str  # pre-tokenizer name, e.g. "smollm"
    tokens: list[str]  # id -> token text (byte-level alphabet)
    token_types: list[int]  # id -> llama.cpp token type
    merges: list[str]  # "left right", by priority
    bos_token_id: int | None  # beginning of sequence
    eos_token_id: int | None  # end of sequence / end of turn
    add_bos_token: bool  # prepend BOS to plain prompts
    chat_template: str | None  # Jinja template, if the file has one


@dataclass
class ModelTokenizer:
    """Encodes prompts (plain or chat) and decodes outputs for one model."""

    tokenizer: Tokenizer  # the `tokenizers` object
    bos_token_id: int | None  # beginning of sequence
    eos_token_id: int | None  # the model's end of turn: a request stops on it
    add_bos_token: bool  # prepend BOS to plain prompts
    chat_template: str | None  # Jinja source, or None
    extra_eos_token_ids: tuple[int, ...] = ()  # more end tokens (generation_config.json)
    _template: Any = field(default=None, repr=False)  # compiled on first use

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        """A plain prompt: special tokens in the text are recognised, BOS added if the
        model wants it."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (
            self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render `messages` through the model's template and encode the result (the
        template writes BOS itself where it wants one)."""
        text = self.render_chat(messages, add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def render_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        if not self.chat_template:
            raise RequestError(
                "this model has no chat template: give a 'prompt' instead of 'messages'"
            )
        _check_messages(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        from jinja2 import TemplateError

        try:
            return _render_bounded(
                self._template,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_token_id),
                eos_token=self.token_text(self.eos_token_id),
            )
        except TemplateError as e:
            raise RequestError(f"the chat template rejected the messages: {e}") from None
        except RecursionError:
            raise RequestError("the chat template recursed too deeply") from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise RequestError(
                f"messages[{i}]: expected an object with string 'role' and 'content'"
            )


def _render_bounded(template: Any, **values: Any) -> str:
    """Render with the limits of engine.limits: the sandbox stops attribute escapes, not a
    template that loops for minutes or builds gigabytes. Output is taken chunk by chunk
    and counted; time is checked on every line the compiled template runs (a trace
    function on this thread, on template frames only, removed afterwards)."""
    from jinja2 import TemplateError

    deadline = time.monotonic() + MAX_TEMPLATE_S

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and time.monotonic() > deadline:
            raise TemplateError(f"rendering took more than {MAX_TEMPLATE_S:g} s")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        parts: list[str] = []
        size = 0
        for chunk in template.generate(**values):
            size += len(chunk)
            if size > MAX_TEMPLATE_CHARS:
                raise TemplateError(f"the rendered prompt exceeds {MAX_TEMPLATE_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        sys.settrace(previous)


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """`*` and `**` checked before they run: `'A' * 3000000000` or `9 ** 9 ** 9`
        would use gigabytes (or minutes) inside one expression, before any check."""

        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (
                        isinstance(seq, (str, list, tuple))
                        and isinstance(n, int)
                        and len(seq) * n > MAX_TEMPLATE_CHARS
                    ):
                        raise TemplateError(
                            f"a repetition of {len(seq) * n} items exceeds {MAX_TEMPLATE_CHARS}"
                        )
            if (
                operator == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right > 4096
            ):
                raise TemplateError(f"the power {left} ** {right} is too large")
            return super().call_binop(context, operator, left, right)

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelError(f"the model's chat template does not compile: {e}") from None


def tokenizer_from_gguf(vocab: GGUFVocab) -> ModelTokenizer:
    """Build the byte-level BPE that llama.cpp would use for this GGUF vocabulary."""
    if vocab.model != "gpt2":
        raise ModelError(
            f"tokenizer.ggml.model={vocab.model!r}: only byte-level BPE ('gpt2') "
            "tokenizers are supported from GGUF; point --model at a Hugging Face "
            "directory with a tokenizer.json instead"
        )
    ids = {tok: i for i, tok in enumerate(vocab.tokens)}
    merges: list[tuple[str, str]] = []
    for m in vocab.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelError(f"tokenizer.ggml.merges: malformed merge {m!r}")
        merges.append((left, right))
    _check_merges(merges, ids)
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(vocab.pre)
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types)
        if kind == TOKEN_TYPE_CONTROL
    ]
    added = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(vocab.tokens, vocab.token_types)
        if kind == TOKEN_TYPE_USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if added:
        tok.add_tokens(added)
    return ModelTokenizer(
        tok, vocab.bos_token_id, vocab.eos_token_id, vocab.add_bos_token, vocab.chat_template
    )


def _check_merges(merges: list[tuple[str, str]], ids: dict[str, int]) -> None:
    """The BPE constructor fails with an untyped error on a merge outside the vocabulary;
    check first so that a corrupt file gets a message naming the merge."""
    for left, right in merges:
        if left not in ids or right not in ids or left + right not in ids:
            raise ModelError(
                f"tokenizer.ggml.merges: merge {left + ' ' + right!r} uses a token "
                "that is not in the vocabulary"
            )


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in _GPT2_NAMES:
        return byte_level
    if name in _DIGIT_FIRST_NAMES:
        # Every digit is its own piece before the GPT-2 split, as llama.cpp does.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if name in _REGEX_NAMES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_NAMES[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted((*_GPT2_NAMES, *_DIGIT_FIRST_NAMES, *_REGEX_NAMES))
    raise ModelError(f"tokenizer.ggml.pre={name!r} is not supported; known: {', '.join(known)}")
