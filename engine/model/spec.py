"""The shape of a Llama-family model, as read from a GGUF file or a config.json."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.errors import ModelError


@dataclass(frozen=True)
class ModelSpec:
    """Architecture hyperparameters: everything needed to build the model and size its KV."""

    name: str  # for messages and trace headers
    vocab_size: int  # rows of the embedding table
    hidden_size: int  # residual stream width
    intermediate_size: int  # SwiGLU inner width
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: fewer than num_heads)
    head_dim: int  # width of one head
    rope_theta: float  # RoPE base frequency
    rms_norm_eps: float  # RMSNorm epsilon
    max_position: int  # context length the model was trained for
    tie_word_embeddings: bool  # the output projection is the embedding table
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelError(f"{self.name}: {name}={value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelError(
                f"{self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelError(f"{self.name}: head_dim={self.head_dim}: RoPE needs an even width")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
