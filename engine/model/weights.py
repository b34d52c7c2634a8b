"""The weight names every loader produces (Hugging Face's Llama names, Q/K rows in the
rotate-half order), and one check of their presence and shapes."""

from __future__ import annotations

import torch

from engine.model.errors import ModelError
from engine.model.spec import ModelSpec

Weights = dict[str, torch.Tensor]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its shape."""
    h, i_size = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {EMBED: (spec.vocab_size, h), FINAL_NORM: (h,)}
    if not spec.tie_word_embeddings:
        shapes[LM_HEAD] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = layer_prefix(i)
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (spec.q_size, h),
                p + "self_attn.k_proj.weight": (spec.kv_size, h),
                p + "self_attn.v_proj.weight": (spec.kv_size, h),
                p + "self_attn.o_proj.weight": (h, spec.q_size),
                p + "mlp.gate_proj.weight": (i_size, h),
                p + "mlp.up_proj.weight": (i_size, h),
                p + "mlp.down_proj.weight": (h, i_size),
            }
        )
        if spec.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (spec.q_size,),
                    p + "self_attn.k_proj.bias": (spec.kv_size,),
                    p + "self_attn.v_proj.bias": (spec.kv_size,),
                }
            )
    return shapes


def check_weights(spec: ModelSpec, weights: Weights, source: str) -> None:
    """Every expected tensor is there with its shape; nothing unexpected is."""
    want = expected_shapes(spec)
    for name, shape in want.items():
        got = weights.get(name)
        if got is None:
            raise ModelError(f"{source}: tensor {name} is missing")
        if tuple(got.shape) != shape:
            raise ModelError(
                f"{source}: tensor {name} has shape {tuple(got.shape)}, expected {shape}"
            )
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ModelError(
            f"{source}: unexpected tensor {extra[0]} (not a plain Llama-family model?)"
        )
