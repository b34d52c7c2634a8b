"""EngineConfig validation: one ValueError naming the field and the value."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, parse_setting


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"block_size": 0}, "block_size=0"),
        ({"num_blocks": 1}, "num_blocks=1"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_batched_tokens=256"),
        (
            {"long_prefill_token_threshold": 9000, "max_model_len": 8192},
            "long_prefill_token_threshold=9000",
        ),
        ({"policy": "lifo"}, "policy='lifo'"),
        ({"watermark": 1.5}, "watermark=1.5"),
        ({"max_num_active_seqs": 999}, "max_num_active_seqs=999"),
        ({"block_size": "16"}, "block_size='16': expected int"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching=1: expected bool"),
        (
            {"enable_chunked_prefill": False, "max_model_len": 8192},
            "when enable_chunked_prefill is off",
        ),
    ],
)
def test_invalid_values_name_the_field(changes: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        EngineConfig().replace(**changes)
    assert needle in str(err.value)


def test_unknown_key() -> None:
    with pytest.raises(ValueError, match="unknown config key 'max_tokens'"):
        EngineConfig().replace(max_tokens=3)


def test_config_is_frozen_and_watermark_blocks() -> None:
    cfg = EngineConfig(num_blocks=100, watermark=0.05)
    assert cfg.watermark_blocks == 5 and cfg.usable_blocks == 99
    with pytest.raises(AttributeError):
        cfg.block_size = 8  # type: ignore[misc]


def test_parse_setting_types() -> None:
    assert parse_setting("max_num_seqs=8") == ("max_num_seqs", 8)
    assert parse_setting("enable-prefix-caching=off") == ("enable_prefix_caching", False)
    assert parse_setting("watermark=0.1") == ("watermark", 0.1)
    assert parse_setting("max_num_active_seqs=none") == ("max_num_active_seqs", None)
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_setting("max_num_seqs")


def test_the_docs_table_is_the_knobs_declarations() -> None:
    """docs/workload-format.md's table of knobs is engine.config's, verbatim."""
    from pathlib import Path

    from engine.config import docs_table

    docs = (Path(__file__).parent.parent / "docs" / "workload-format.md").read_text()
    want = docs_table()
    start = docs.find(want.splitlines()[0])
    got = docs[start : docs.index("\n\n", start) + 1] if start >= 0 else ""
    assert got == want, "replace the table in docs/workload-format.md with:\n" + want


def test_every_knob_has_one_declaration() -> None:
    """Flags, --set keys and workload keys all come from the same knobs."""
    from engine.config import ALIASES, KNOBS, RunnerOptions, knob_named

    assert set(KNOBS) == set(EngineConfig().to_dict()) | set(RunnerOptions().__dict__)
    assert ALIASES == {"scheduling_policy": "policy"}
    assert knob_named("scheduling-policy").name == "policy"
    assert parse_setting("scheduling_policy=priority") == ("policy", "priority")
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert parse_setting(f"speculative_config={spec}")[1].num_speculative_tokens == 2
    with pytest.raises(ValueError, match="unknown config key 'device'"):
        parse_setting("device=cpu")  # --set takes the engine's knobs only
    for k in KNOBS.values():
        assert k.help and k.help.endswith("."), k.name
        assert k.flag is None or k.flag.startswith("--"), k.name
