"""Hugging Face model directories: config.json, *.safetensors (one file or shards) and
tokenizer.json (with tokenizer_config.json for the chat template and special tokens).

Llama-family architectures only: Llama, SmolLM (a Llama), Mistral without a sliding
window, and Qwen2 (biases on the q/k/v projections)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.model.errors import ModelError
from engine.model.spec import ModelSpec
from engine.model.tokenizer import ModelTokenizer
from engine.model.weights import Weights, check_weights

MODEL_TYPES = ("llama", "mistral", "qwen2")


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def load_hf_dir(path: Path) -> tuple[ModelSpec, Weights, ModelTokenizer]:
    config = _read_json(path / "config.json")
    spec = spec_from_config(config, path.name)
    weights = _read_safetensors(path)
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some exports store the tied copy too
    check_weights(spec, weights, str(path))
    return spec, weights, _tokenizer(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: no such file") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: not valid JSON: {e}") from None


def spec_from_config(cfg: Any, name: str) -> ModelSpec:
    """A ModelSpec from a config.json object; unsupported features are a ModelError."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{name}/config.json: expected a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelError(
            f"{name}: model_type {model_type!r} is not supported (supported: "
            f"{', '.join(MODEL_TYPES)})"
        )
    # Older configs: rope_theta + rope_scaling; newer ones: rope_parameters.
    rope: dict[str, Any] = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (
        not isinstance(rope, dict)
        or rope.get("rope_type", rope.get("type", "default")) != "default"
    ):
        raise ModelError(f"{name}: RoPE scaling {rope!r} is not supported")
    if cfg.get("mlp_bias"):
        raise ModelError(f"{name}: mlp_bias is not supported")
    window = cfg.get("sliding_window")
    if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
        raise ModelError(f"{name}: sliding-window attention is not supported")
    heads = _int(cfg, "num_attention_heads", name)
    hidden = _int(cfg, "hidden_size", name)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or name),
        vocab_size=_int(cfg, "vocab_size", name),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", name),
        num_layers=_int(cfg, "num_hidden_layers", name),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=_int(cfg, "max_position_embeddings", name),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
    )


def _int(cfg: dict[str, Any], key: str, name: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{name}/config.json: {key}={value!r}: expected an integer")
    return value


def _read_safetensors(path: Path) -> Weights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors file (only safetensors weights are read)")
    weights: Weights = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelError(f"{f}: not a valid safetensors file: {e}") from None
    return {k: v.float() for k, v in weights.items()}


def _tokenizer(path: Path) -> ModelTokenizer:
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    if not file.is_file():
        raise ModelError(f"{path}: tokenizer.json is missing")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception
        raise ModelError(f"{file}: not a valid tokenizer.json: {e}") from None
    cfg = (
        _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer_config.json").is_file()
        else {}
    )
    gen = (
        _read_json(path / "generation_config.json")
        if (path / "generation_config.json").is_file()
        else {}
    )
    bos = _token_id(tok, cfg.get("bos_token"))
    eos_ids = _eos_ids(tok, cfg, gen)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next(
            (
                t.get("template")
                for t in template
                if isinstance(t, dict) and t.get("name") == "default"
            ),
            None,
        )
    jinja = path / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text()
    return ModelTokenizer(
        tok,
        bos,
        eos_ids[0] if eos_ids else None,
        bool(cfg.get("add_bos_token", False)),
        template if isinstance(template, str) else None,
        extra_eos_token_ids=tuple(eos_ids[1:]),
    )


def _token_id(tok: Any, token: Any) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    value = tok.token_to_id(token)
    return int(value) if value is not None else None


def _eos_ids(tok: Any, cfg: dict[str, Any], gen: dict[str, Any]) -> list[int]:
    """The tokenizer's EOS first, then any others generation_config.json names."""
    ids: list[int] = []
    first = _token_id(tok, cfg.get("eos_token"))
    if first is not None:
        ids.append(first)
    more = gen.get("eos_token_id")
    for t in more if isinstance(more, list) else [more]:
        if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
            ids.append(t)
    return ids
