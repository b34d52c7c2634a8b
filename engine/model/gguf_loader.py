"""GGUF files (llama.cpp's format): metadata to a ModelSpec, tensors dequantized to fp32
under Hugging Face names, the vocabulary to a tokenizer.

llama.cpp stores the Q and K rows of a Llama model permuted within each head (its RoPE
rotates adjacent pairs); the loader undoes that so the model can use rotate-half RoPE.
A file without `output.weight` ties the output projection to the embeddings."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model.errors import ModelError
from engine.model.gguf_meta import GGUFMetadata, read_metadata, vocab
from engine.model.spec import ModelSpec
from engine.model.tokenizer import ModelTokenizer, tokenizer_from_gguf
from engine.model.weights import EMBED, FINAL_NORM, LM_HEAD, Weights, check_weights

# Architectures read, and whether llama.cpp's converter permuted their Q/K rows.
ARCHITECTURES = {"llama": True, "qwen2": False}
_READ_ERRORS = (
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    OSError,
    struct.error,
    UnicodeDecodeError,
    OverflowError,
)
_GLOBAL_NAMES = {
    "token_embd.weight": EMBED,
    "output_norm.weight": FINAL_NORM,
    "output.weight": LM_HEAD,
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(path: Path) -> tuple[ModelSpec, Weights, ModelTokenizer]:
    """Read a GGUF file. Any malformation is a ModelError naming the file."""
    from gguf import GGUFReader

    meta = read_metadata(path)  # the metadata without numpy; GGUFReader for the tensors
    try:
        reader = GGUFReader(path, "r")
        arch = meta.text("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"{path}: architecture {arch!r} is not supported (supported: "
                f"{', '.join(ARCHITECTURES)})"
            )
        tensors = {t.name: t for t in reader.tensors}
        spec = _spec(meta, arch, tensors, path)
        tokens = vocab(meta)
        weights = _weights(tensors, spec, permuted=ARCHITECTURES[arch], path=path)
    except _READ_ERRORS as e:
        raise ModelError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
    check_weights(spec, weights, str(path))
    return spec, weights, tokenizer_from_gguf(tokens)


def _spec(meta: GGUFMetadata, arch: str, tensors: dict[str, Any], path: Path) -> ModelSpec:
    hidden = meta.integer(f"{arch}.embedding_length")
    heads = meta.integer(f"{arch}.attention.head_count")
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
        raise ModelError(f"{path}: bad embedding_length/head_count")
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelError(f"{path}: tensor token_embd.weight is missing")
    head_dim = meta.integer(f"{arch}.attention.key_length", hidden // heads)
    if (
        meta.get(f"{arch}.rope.scaling.type", None) not in (None, "none")
        or "rope_freqs.weight" in tensors
    ):
        raise ModelError(f"{path}: RoPE scaling is not supported")
    return ModelSpec(
        name=meta.text("general.name", path.stem) or path.stem,
        vocab_size=int(embed.shape[-1]),
        hidden_size=hidden,
        intermediate_size=meta.integer(f"{arch}.feed_forward_length"),
        num_layers=meta.integer(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=meta.integer(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=meta.number(f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=meta.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        max_position=meta.integer(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


def hf_name(gguf_name: str, path: Path | str = "") -> str:
    """The Hugging Face name of a GGUF tensor; unknown names are a ModelError."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in _BLOCK_NAMES
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    raise ModelError(f"{path}: unexpected tensor {gguf_name!r} (not a plain Llama-family model?)")


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K rows (and biases): within each head,
    rows (pair, half) become (half, pair), which is the rotate-half layout."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's permutation (the inverse of unpermute_rows): for writing test files."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _weights(tensors: dict[str, Any], spec: ModelSpec, permuted: bool, path: Path) -> Weights:
    from gguf.quants import dequantize

    weights: Weights = {}
    for name, t in tensors.items():
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which cannot be dequantized"
            ) from None
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        target = hf_name(name, path)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            heads = spec.num_heads if ".attn_q." in name else spec.num_kv_heads
            arr = unpermute_rows(arr, heads)
        if not arr.flags.writeable:
            arr = arr.copy()  # F32 tensors are views of the read-only memory map
        weights[target] = torch.from_numpy(arr)
    return weights
