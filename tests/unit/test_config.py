"""The engine's defaults have one home (config.py): a config that names no prefill chunk or
delay gets the device's, resolved where the engine is built, and the flags pass through."""

from __future__ import annotations

import pytest

from omlx_logprobs.api.core.sampled import MAX_ANSWERS
from omlx_logprobs.config import PREFILL_CHUNK, PREFILL_DELAY_MS, EngineConfig
from omlx_logprobs.options import build_parser
from omlx_logprobs.serve_config import config_from_args, engine_config


def test_prefill_defaults_by_device() -> None:
    cfg = EngineConfig()
    assert (cfg.prefill_chunk, cfg.prefill_delay_ms) == (None, None)
    assert cfg.prefill(cpu=True) == (1024, 0.0) == (PREFILL_CHUNK[0], PREFILL_DELAY_MS[0])
    assert cfg.prefill(cpu=False) == (2048, 20.0) == (PREFILL_CHUNK[1], PREFILL_DELAY_MS[1])


def test_given_prefill_values_win_on_either_device() -> None:
    cfg = EngineConfig(prefill_chunk=64, prefill_delay_ms=5.0)
    assert cfg.prefill(cpu=True) == cfg.prefill(cpu=False) == (64, 5.0)
    assert EngineConfig(prefill_delay_ms=0.0).prefill(cpu=False) == (2048, 0.0)


def test_flags_pass_the_prefill_values_through() -> None:
    parse = build_parser().parse_args
    plain = engine_config(parse(["serve"]))
    assert (plain.prefill_chunk, plain.prefill_delay_ms) == (None, None)
    assert plain.prefix_cache_mib is None and EngineConfig().prefix_cache_mib is None
    given = engine_config(parse(["serve", "--prefill-chunk", "300", "--prefill-delay-ms", "7"]))
    assert (given.prefill_chunk, given.prefill_delay_ms) == (300, 7.0)


@pytest.mark.parametrize("field, value", [("prefill_chunk", 0), ("prefill_delay_ms", -1.0)])
def test_out_of_range_prefill_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_reasoning_budgets_flag() -> None:
    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).reasoning_budgets == ()
    cfg = engine_config(parse(["serve", "--reasoning-budgets", "low=1024, medium=4096,high=0"]))
    assert cfg.reasoning_budgets == (("low", 1024), ("medium", 4096), ("high", 0))
    for bad in ("low", "low=x", "low=-1", "huge=5", "low=1.5"):
        with pytest.raises(ValueError):
            engine_config(parse(["serve", "--reasoning-budgets", bad]))


def test_metrics_and_the_faithful_store_switch_off() -> None:
    parse = build_parser().parse_args
    plain = config_from_args(parse(["serve"]))
    assert plain.metrics and plain.faithful_answers == MAX_ANSWERS == 4096
    off = config_from_args(parse(["serve", "--no-metrics", "--faithful-answers", "0"]))
    assert (off.metrics, off.faithful_answers) == (False, 0)
    with pytest.raises(ValueError, match="faithful_answers"):
        config_from_args(parse(["serve", "--faithful-answers", "-1"]))
