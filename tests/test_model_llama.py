"""The model on tiny random weights: against Hugging Face transformers (Llama, and Qwen2
with q/k/v biases), through the paged cache in chunks; and the loaders (GGUF as
llama.cpp writes it, Hugging Face directories)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.model.attention.metadata import build_metadata
from engine.model.attention.torch_backend import TorchAttention
from engine.model.gguf_loader import permute_rows, unpermute_rows
from engine.model.kv_cache import KVCache
from engine.model.llama import LlamaModel
from engine.model.loader import load_model
from engine.model.spec import ModelSpec
from engine.model.weights import Weights
from tests.model_support import CHATML, tiny_spec, tiny_tokenizer, tiny_weights, write_gguf

CPU = torch.device("cpu")


def hf_model(spec: ModelSpec, weights: Weights) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=spec.max_position,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
    )
    if spec.attention_bias:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    state = dict(weights)
    if spec.tie_word_embeddings:
        state["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


def paged_logits(
    spec: ModelSpec, weights: Weights, ids: list[int], chunks: list[int]
) -> torch.Tensor:
    """Logits of every position, computed chunk by chunk through a paged cache whose
    blocks are handed out in a scrambled order."""
    model = LlamaModel(
        spec,
        weights,
        TorchAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim),
        CPU,
        torch.float32,
    )
    bs = 8
    kv = KVCache(spec, 32, bs, torch.float32, CPU)
    table = np.array([[7, 3, 12, 1, 30, 9, 22, 5, 17, 2]])
    out, done = [], 0
    for n in chunks:
        pos = np.arange(done, done + n)
        slots = table[0, pos // bs] * bs + pos % bs
        meta = build_metadata(np.array([n]), np.array([done + n]), table, slots, CPU)
        with torch.inference_mode():
            hidden = model.forward(
                torch.tensor(ids[done : done + n]), torch.from_numpy(pos), meta, kv.layers
            )
            out.append(model.compute_logits(hidden))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2-biases"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_model_matches_transformers_through_the_paged_cache(bias: bool, tied: bool) -> None:
    spec = tiny_spec(attention_bias=bias, tie_word_embeddings=tied)
    weights = tiny_weights(spec, seed=5)
    ids = [
        int(t)
        for t in torch.randint(
            0, spec.vocab_size, (37,), generator=torch.Generator().manual_seed(1)
        )
    ]
    with torch.inference_mode():
        want = hf_model(spec, weights)(torch.tensor([ids])).logits[0]
    for chunks in ([37], [8, 8, 5, 16], [1] * 37):
        got = paged_logits(spec, weights, ids, chunks)
        rel = ((got - want).abs().max() / want.abs().max()).item()
        assert rel < 1e-5, f"chunks {chunks}: relative error {rel:.2e}"


def test_permutation_round_trip() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert np.array_equal(unpermute_rows(permute_rows(w, 6), 6), w)
    # llama.cpp interleaves each head's two halves: row 1 of a head is row d/2 of ours.
    permuted = permute_rows(w, 6)
    assert np.array_equal(permuted[1], w[4]) and np.array_equal(permuted[8], w[8])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_file_loads_back_the_weights_it_was_written_from(tmp_path: Path, arch: str) -> None:
    spec = tiny_spec(name=f"tiny-{arch}", attention_bias=arch == "qwen2")
    weights = tiny_weights(spec, seed=2)
    loaded = load_model(write_gguf(tmp_path / "m.gguf", spec, weights, arch=arch))
    assert loaded.spec.tie_word_embeddings and loaded.spec.attention_bias == (arch == "qwen2")
    assert loaded.spec.num_kv_heads == 2 and loaded.spec.max_position == 512
    assert set(loaded.weights) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    tok = loaded.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "héllo 42"}])
    assert ids[0] == 1 and tok.decode(ids) == "user\nhéllo 42\nassistant\n"


def test_untied_gguf_has_an_output_projection(tmp_path: Path) -> None:
    spec = tiny_spec(tie_word_embeddings=False)
    loaded = load_model(write_gguf(tmp_path / "m.gguf", spec, tiny_weights(spec)))
    assert not loaded.spec.tie_word_embeddings and "lm_head.weight" in loaded.weights


def save_hf_dir(
    path: Path, spec: ModelSpec, weights: Weights, extra_config: dict[str, Any] | None = None
) -> Path:
    hf_model(spec, weights).save_pretrained(path)
    tiny_tokenizer().tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    if extra_config:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(extra_config)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("bias", [False, True], ids=["llama", "qwen2"])
def test_hugging_face_directory_loads(tmp_path: Path, bias: bool) -> None:
    spec = tiny_spec(attention_bias=bias)
    weights = tiny_weights(spec, seed=4)
    loaded = load_model(save_hf_dir(tmp_path, spec, weights))
    assert loaded.spec.hidden_size == spec.hidden_size
    assert loaded.spec.attention_bias == bias and loaded.spec.tie_word_embeddings
    for name, tensor in weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    tok = loaded.tokenizer
    assert (tok.eos_token_id, tok.bos_token_id, tok.extra_eos_token_ids) == (2, 1, (0,))
    ids = tok.apply_chat_template([{"role": "user", "content": "x"}])
    assert ids[0] == 1 and tok.decode(ids) == "user\nx\nassistant\n"
