"""The Llama architecture over a paged KV cache: GQA, RoPE (rotate-half), RMSNorm, SwiGLU,
tied or untied output projection, optional q/k/v biases (Qwen2).

The forward pass takes one flat batch of tokens from many requests; attention reads and
writes the paged cache through the step's AttentionMetadata. Q/K/V and gate/up are fused
into one matrix each: two GEMMs fewer per layer, which matters at small batch sizes. On
the CPU in fp32 the matrices are packed once for oneDNN (engine/model/cpu_linear.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.model.attention.metadata import AttentionMetadata
from engine.model.cpu_linear import choose_linear
from engine.model.spec import ModelSpec
from engine.model.weights import EMBED, FINAL_NORM, LM_HEAD, Weights, layer_prefix


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache, then attends over each request's blocks."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


@dataclass
class _Layer:
    """One decoder block's weights, fused for speed."""

    input_norm: torch.Tensor  # [H] RMSNorm before attention
    qkv: torch.Tensor  # [q + 2 kv, H] fused projections (packed: only for self.linear)
    qkv_bias: torch.Tensor | None  # [q + 2 kv] or None
    o_proj: torch.Tensor  # [H, q]
    post_norm: torch.Tensor  # [H] RMSNorm before the MLP
    gate_up: torch.Tensor  # [2 I, H] fused gate and up projections
    down: torch.Tensor  # [H, I]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_tables(spec: ModelSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_position, head_dim / 2], fp32."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.arange(spec.max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(device), freqs.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]; cos/sin are [T, 1, D/2] in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel:
    """A Llama-family decoder that computes a flat batch of tokens over paged KV."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        attention: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.attention = attention
        self.device = device
        self.dtype = dtype
        self.linear = choose_linear(device, dtype)

        def take(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = take(EMBED)
        self.final_norm = take(FINAL_NORM)
        # tied: the embedding stays dense for lookups, the LM head gets its own packing
        self.lm_head = self.linear.pack(self.embed if spec.tie_word_embeddings else take(LM_HEAD))
        self.layers = [self._layer(i, weights, take) for i in range(spec.num_layers)]
        cos, sin = rope_tables(spec, device)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)

    def _layer(self, i: int, weights: Weights, take: Callable[[str], torch.Tensor]) -> _Layer:
        p = layer_prefix(i)
        a, m = p + "self_attn.", p + "mlp."
        qkv = torch.cat([weights[a + n + "_proj.weight"] for n in "qkv"])
        bias = None
        if self.spec.attention_bias:
            bias = torch.cat([weights[a + n + "_proj.bias"] for n in "qkv"]).to(
                device=self.device, dtype=self.dtype
            )
        gate_up = torch.cat([weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])
        pack = self.linear.pack
        return _Layer(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=pack(qkv.to(device=self.device, dtype=self.dtype).contiguous()),
            qkv_bias=bias,
            o_proj=pack(take(a + "o_proj.weight")),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=pack(gate_up.to(device=self.device, dtype=self.dtype).contiguous()),
            down=pack(take(m + "down_proj.weight")),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, H] after the last block (before the final norm)."""
        spec = self.spec
        h = F.embedding(input_ids, self.embed)
        cos = self.cos.index_select(0, positions).unsqueeze(1)
        sin = self.sin.index_select(0, positions).unsqueeze(1)
        n_tok = h.shape[0]
        q_size, kv_size = spec.q_size, spec.kv_size
        linear = self.linear
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x = rms_norm(h, layer.input_norm, spec.rms_norm_eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_size].view(n_tok, spec.num_heads, spec.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n_tok, spec.num_kv_heads, spec.head_dim)
            v = qkv[:, q_size + kv_size :].view(n_tok, spec.num_kv_heads, spec.head_dim)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = self.attention.forward(q, k, v.contiguous(), k_cache, v_cache, meta)
            h = h + linear(attn.reshape(n_tok, q_size), layer.o_proj)
            x = rms_norm(h, layer.post_norm, spec.rms_norm_eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer.down)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] in fp32 for the rows of `hidden` that sample."""
        x = rms_norm(hidden, self.final_norm, self.spec.rms_norm_eps)
        return self.linear(x, self.lm_head).float()
