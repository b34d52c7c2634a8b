"""Issue 14, classes 2 and 3: every numeric knob and workload field has one documented range
(engine.limits), enforced where the config or workload is validated, with a message naming
the key and the range; the readers' limits are the writers'; hostile workload files are a
one-line error, never a traceback or a hang. Real files, real `schedtop` processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from engine.config import EngineConfig, RunnerOptions
from engine.limits import MAX_NUM_BLOCKS, RANGES, fmt_bound
from engine.request import SamplingParams
from recorder import schema
from replays.state import MAX_BLOCKS
from tui.cli import main

CONFIG_INTS = [
    "block_size",
    "num_blocks",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "long_prefill_token_threshold",
    "num_speculative_tokens",
]


def schedtop(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def one_line_error(result: Result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr


@pytest.mark.parametrize("key", CONFIG_INTS)
def test_every_config_knob_is_refused_just_outside_its_range(key: str) -> None:
    lo, hi = RANGES[key]
    for bad in (lo - 1, hi + 1, 10**20):
        with pytest.raises(ValueError) as e:
            EngineConfig(**{key: int(bad)})
        assert str(e.value).startswith(
            f"{key}={int(bad)}: must be in [{fmt_bound(lo)}, {fmt_bound(hi)}]"
        )


def test_the_range_ends_are_accepted() -> None:
    EngineConfig(num_blocks=MAX_NUM_BLOCKS, max_model_len=RANGES["max_model_len"][1])
    EngineConfig(num_speculative_tokens=int(RANGES["num_speculative_tokens"][1]))
    EngineConfig(block_size=1, num_blocks=2, max_num_seqs=1, max_num_batched_tokens=1)


def test_readers_accept_exactly_what_writers_may_write() -> None:
    assert MAX_BLOCKS == schema.MAX_BLOCKS == MAX_NUM_BLOCKS == RANGES["num_blocks"][1]
    assert RANGES["num_gpu_blocks_override"][1] == MAX_NUM_BLOCKS


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"num_threads": 100000}, "num_threads"),
        ({"kv_cache_memory": 100 << 40}, "kv_cache_memory"),
        ({"num_gpu_blocks_override": MAX_NUM_BLOCKS + 1}, "num_gpu_blocks_override"),
        ({"seed": 10**23}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"profile_every": -1}, "profile_every"),
    ],
)
def test_runner_options_have_ranges(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        RunnerOptions(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": 10**23},
        {"max_tokens": 10**12},
        {"seed": 1 << 64},
        {"stop_token_ids": (-1,)},
        {"top_p": float("nan")},
    ],
)
def test_sampling_params_have_ranges(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sim_set_refuses_huge_values_naming_key_and_range(tmp_path: Path) -> None:
    case = Path(__file__).parent / "data" / "fidelity" / "c_kv_pressure_prefix.workload.json"
    for setting, words in [
        ("num_blocks=99999999999999999999", ("num_blocks", "2^22")),
        ("num_blocks=4194305", ("num_blocks", "2^22")),
        ("num_speculative_tokens=1000000000", ("num_speculative_tokens", "64")),
        ("max_model_len=1000000000000", ("max_model_len", "2^24")),
    ]:
        one_line_error(schedtop("sim", str(case), "--no-trace", "--set", setting), *words)


def sim_workload(tmp_path: Path, request: dict[str, Any], **config: Any) -> Path:
    base = {"id": "a", "prompt_token_ids": [1, 2, 3], "output_token_ids": [4], "max_tokens": 1}
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"config": config, "requests": [{**base, **request}]}))
    return path


@pytest.mark.parametrize(
    "request_fields, words",
    [
        ({"max_token": 3}, ("unknown field 'max_token'",)),
        ({"max_tokens": 10**12}, ("max_tokens", "2^24")),
        ({"prompt_token_ids": [1 << 64]}, ("not a token id",)),
        ({"output_token_ids": [-1]}, ("not a token id",)),
        ({"priority": 1 << 63}, ("priority", "2^63-1")),
        ({"id": "\ud800"}, ("not valid Unicode",)),
        ({"arrival_step": 1 << 40}, ("arrival_step",)),
    ],
)
def test_sim_workload_fields_have_ranges(
    tmp_path: Path, request_fields: dict[str, Any], words: tuple[str, ...]
) -> None:
    one_line_error(
        schedtop("sim", str(sim_workload(tmp_path, request_fields)), "--no-trace"), *words
    )


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"requests": [{"id": "\xff"}]}', ("not UTF-8",)),
        (b"[" * 100000, ("not valid JSON",)),
    ],
)
def test_sim_unreadable_workloads_are_one_line(
    tmp_path: Path, content: bytes, words: tuple[str, ...]
) -> None:
    path = tmp_path / "w.json"
    path.write_bytes(content)
    one_line_error(schedtop("sim", str(path), "--no-trace"), *words)


def run_workload_file(tmp_path: Path, request: dict[str, Any], **config: Any) -> Path:
    base = {"id": "a", "prompt": "hi", "sampling": {"max_tokens": 2}}
    path = tmp_path / "w.json"
    text = json.dumps({"config": config, "requests": [{**base, **request}]})
    path.write_text(text.replace('"__NAN__"', "NaN").replace('"__INF__"', "Infinity"))
    return path


@pytest.mark.parametrize(
    "request_fields, config, words",
    [
        ({"arrival_time": "__NAN__"}, {}, ("arrival_time=nan",)),
        ({"arrival_time": "__INF__"}, {}, ("arrival_time=inf",)),
        ({"arrival_time": 1e300}, {}, ("arrival_time",)),
        ({"sampling": {"priority": 1 << 63}}, {}, ("priority",)),
        ({}, {"seed": 10**23}, ("seed",)),
        ({}, {"seed": "x"}, ("seed",)),
        ({}, {"model": 5}, ("model=5",)),
        ({}, {"num_threads": 100000}, ("num_threads",)),
        ({}, {"num_gpu_blocks_override": 10**15}, ("num_gpu_blocks_override",)),
        ({}, {"max_num_batched_tokens": 10**15}, ("max_num_batched_tokens",)),
        ({}, {"kv_cache_memory": "100TiB"}, ("kv_cache_memory",)),
    ],
)
def test_run_refuses_bad_input_before_loading_the_model(
    tmp_path: Path, request_fields: dict[str, Any], config: dict[str, Any], words: tuple[str, ...]
) -> None:
    # the model path does not exist: every one of these must be refused before it is opened
    workload = run_workload_file(tmp_path, request_fields, **config)
    result = schedtop("run", "--model", str(tmp_path / "absent.gguf"), "--workload", str(workload))
    one_line_error(result, *words)
    assert "no model at" not in result.stderr


def test_run_cli_options_have_ranges(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.gguf")
    one_line_error(
        schedtop("run", "--model", absent, "--num-gpu-blocks-override", str(10**15)),
        "num_gpu_blocks_override",
    )
    one_line_error(
        schedtop("run", "--model", absent, "--max-num-batched-tokens", str(10**15)),
        "max_num_batched_tokens",
    )
    one_line_error(schedtop("run", "--model", absent, "--kv-cache-memory", "100TiB"), "kv_cache")


def test_a_real_process_refuses_a_nan_arrival_at_once(tmp_path: Path) -> None:
    """It used to hang forever: a real process, bounded by a timeout."""
    workload = run_workload_file(tmp_path, {"arrival_time": "__NAN__"})
    proc = subprocess.run(
        [sys.executable, "-m", "tui.cli", "run", "--workload", str(workload), "--no-trace"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "arrival_time=nan" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_out_of_range_sampling_fails_that_request_and_the_others_run(tmp_path: Path) -> None:
    from engine.model.api import run_workload
    from engine.model.workload import parse_run_workload
    from tests.model_support import write_tiny_gguf

    greedy = {"max_tokens": 3, "temperature": 0.0}
    requests = [
        {"id": "ok", "prompt_token_ids": [5, 6, 7], "sampling": greedy},
        {"id": "nan", "prompt_token_ids": [5, 6], "sampling": {"temperature": float("nan")}},
        {"id": "topk", "prompt_token_ids": [5, 6], "sampling": {"top_k": 10**23}},
        {"id": "stop", "prompt_token_ids": [5, 6], "sampling": {"stop_token_ids": [-3]}},
        {"id": "huge", "prompt_token_ids": [5, 1 << 64], "sampling": greedy},
    ]
    w = parse_run_workload(
        {"config": {"num_gpu_blocks_override": 32, "max_model_len": 64}, "requests": requests}
    )
    summary = run_workload(w, write_tiny_gguf(tmp_path))
    errors = dict(summary.errors)
    assert set(errors) == {"nan", "topk", "stop", "huge"} and summary.num_finished == 1
    assert "temperature" in errors["nan"] and "top_k" in errors["topk"]
    assert "stop_token_ids" in errors["stop"]
