"""A GGUF file's key/value metadata (llama.cpp's format, versions 2 and 3) in plain Python:
no numpy, no torch. The model's shape and its tokenizer come from here; only the weights
need the `gguf` package (engine.model.gguf_loader), so `schedtop sim` can tokenize a run
workload's prompts with the default model's tokenizer without loading either."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from engine.model.errors import ModelError
from engine.model.tokenizer import GGUFVocab, ModelTokenizer, tokenizer_from_gguf

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 64-bit lengths and counts (version 1 had 32-bit ones and is long gone)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_READ_ERRORS = (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError)
_MISSING = object()


def read_metadata(path: Path) -> GGUFMetadata:
    """The metadata of the GGUF file at `path`; a ModelError names what is wrong."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                try:
                    fields = _Parser(buf).fields()
                except _READ_ERRORS as e:
                    raise ModelError(
                        f"{path}: not a valid GGUF file ({type(e).__name__}: {e})"
                    ) from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror or e}") from None
    return GGUFMetadata(fields, path)


def load_gguf_tokenizer(path: Path) -> ModelTokenizer:
    """Only the tokenizer of a GGUF file (its metadata; no tensor is read)."""
    return tokenizer_from_gguf(vocab(read_metadata(path)))


class _Parser:
    """Reads the header and key/value pairs, bounds-checked against the file's size (a
    corrupt count must fail, not allocate)."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 4

    def fields(self) -> dict[str, Any]:
        version = self._scalar("I")
        if version not in VERSIONS:
            raise ValueError(f"version {version} (supported: 2, 3)")
        self._scalar("Q")  # tensor count: the tensors are the weights loader's business
        count = self._count(self._scalar("Q"), 9)  # a key and a type at least
        out: dict[str, Any] = {}
        for _ in range(count):
            key = self._string()
            out[key] = self._value(self._scalar("I"))
        return out

    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _count(self, n: int, min_size: int) -> int:
        if n * min_size > len(self.buf) - self.pos:
            raise ValueError(f"a count of {n} runs past the end of the file")
        return n

    def _string(self) -> str:
        n = self._count(self._scalar("Q"), 1)
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        item = self._scalar("I")
        n = self._scalar("Q")
        if item in _SCALARS:  # one unpack for the whole array: token types are 49k ints
            fmt = f"<{self._count(n, struct.calcsize(_SCALARS[item]))}{_SCALARS[item]}"
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self._value(item) for _ in range(self._count(n, 1))]


class GGUFMetadata:
    """Typed access to GGUF key/value fields, with errors that name the key."""

    def __init__(self, fields: dict[str, Any], path: Path) -> None:
        self.fields = fields  # key -> value (int, float, bool, str, or a list of them)
        self.path = path  # for messages

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.fields:
            if default is _MISSING:
                raise ModelError(f"{self.path}: metadata {key} is missing")
            return default
        return self.fields[key]

    def integer(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ModelError(f"{self.path}: metadata {key}={value!r}: expected an integer")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelError(f"{self.path}: metadata {key}={value!r}: expected a number")
        return float(value)

    def text(self, key: str, default: Any = _MISSING) -> Any:
        value = self.get(key, default)
        if value is not None and not isinstance(value, str):
            raise ModelError(f"{self.path}: metadata {key}={value!r}: expected a string")
        return value

    def array(self, key: str) -> list[Any]:
        value = self.get(key)
        if not isinstance(value, list):
            raise ModelError(f"{self.path}: metadata {key}: expected an array")
        return value

    def context_length(self) -> int | None:
        """The model's context (`{arch}.context_length`), if the file says."""
        arch = self.get("general.architecture", None)
        value = self.get(f"{arch}.context_length", None) if isinstance(arch, str) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def vocab(meta: GGUFMetadata) -> GGUFVocab:
    """The tokenizer as the file stores it (tokenizer.ggml.*)."""
    tokens = meta.array("tokenizer.ggml.tokens")
    types = (
        meta.array("tokenizer.ggml.token_type")
        if "tokenizer.ggml.token_type" in meta.fields
        else [1] * len(tokens)
    )
    if len(types) != len(tokens):
        raise ModelError(
            f"{meta.path}: tokenizer.ggml.token_type has {len(types)} entries "
            f"for {len(tokens)} tokens"
        )
    return GGUFVocab(
        model=meta.text("tokenizer.ggml.model"),
        pre=meta.text("tokenizer.ggml.pre", "default") or "default",
        tokens=tokens,
        token_types=[int(t) for t in types],
        merges=meta.array("tokenizer.ggml.merges")
        if "tokenizer.ggml.merges" in meta.fields
        else [],
        bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.integer("tokenizer.ggml.eos_token_id", None),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.text("tokenizer.chat_template", None),
    )
