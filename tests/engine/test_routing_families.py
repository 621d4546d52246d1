"""runner/routing.py on each MoE family it knows, built here from a config with seeded random
weights: recording changes nothing the block computes (bit for bit), the recorded ids are the
router's top-k, replaying them gives the same output bit for bit and replaying others does not,
and models/moe.py reads the same routing shape from the config as the blocks have."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.models.moe import RoutingShape, routing_shape
from omlx_logprobs.runner.routing import Routing, RowSpan, install

SMALL = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 128,
         "num_experts_per_tok": 2, "intermediate_size": 48}  # fmt: skip
CONFIGS: dict[str, dict[str, Any]] = {
    # the second layer dense: moe_layers counts the other two
    "qwen3_moe": {
        **SMALL,
        "num_experts": 6,
        "moe_intermediate_size": 16,
        "head_dim": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },  # fmt: skip
    "qwen2_moe": {
        **SMALL,
        "num_experts": 6,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
    },  # fmt: skip
    "mixtral": {**SMALL, "num_local_experts": 6},
}
LAYERS = {"qwen3_moe": 2, "qwen2_moe": 3, "mixtral": 3}


def build(name: str, tmp_path: Path) -> tuple[Any, Path]:
    config = {"model_type": name, **CONFIGS[name]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(5)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, tmp_path


def asking() -> Any:
    return SimpleNamespace(params=SimpleNamespace(return_routed_experts=True), replay=None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_recording_and_replaying_each_family(name: str, tmp_path: Path) -> None:
    model, path = build(name, tmp_path)
    ids = mx.array([[3, 17, 42, 99, 5, 64, 7, 21], [9, 8, 7, 6, 5, 4, 3, 2]])
    before = np.array(model(ids))
    routing = install(model)
    assert isinstance(routing, Routing)
    assert routing_shape(path) == RoutingShape(LAYERS[name], 2, 6)
    assert (routing.layers, routing.top_k, routing.experts) == (LAYERS[name], 2, 6)
    np.testing.assert_array_equal(np.array(model(ids)), before)  # not recording

    rows = [RowSpan([asking()], 0, 8), RowSpan([asking()], 0, 8)]
    recorded = np.array(routing.run(lambda: model(ids), rows, 8))
    np.testing.assert_array_equal(recorded, before)
    pieces = routing.take()
    used = np.stack([np.array(r) for _, _, r in pieces])  # [rows, 8, layers, 2]
    assert used.shape == (2, 8, LAYERS[name], 2) and used.dtype == np.int16
    assert (np.sort(used, axis=-1)[..., 0] != np.sort(used, axis=-1)[..., 1]).all()

    # replayed: its own routing gives the same numbers; another routing (row 0 only) does not
    def replaying(given: np.ndarray) -> Any:
        return SimpleNamespace(params=SimpleNamespace(return_routed_experts=False), replay=given)

    same = [RowSpan([replaying(used[0])], 0, 8), RowSpan([replaying(used[1])], 0, 8)]
    np.testing.assert_array_equal(np.array(routing.run(lambda: model(ids), same, 8)), before)
    moved = ((used[0] + 1) % 6).astype(np.int16)
    other = [RowSpan([replaying(moved)], 0, 8), RowSpan([asking()], 0, 8)]
    out = np.array(routing.run(lambda: model(ids), other, 8))
    assert np.abs(out[0] - before[0]).max() > 1e-3
    np.testing.assert_array_equal(out[1], before[1])
    np.testing.assert_array_equal(np.array(routing.take()[0][2]), used[1])
    assert install(model) is routing  # a second runner of the same model shares it


def test_a_dense_model_has_no_routing(tmp_path: Path) -> None:
    config = {"model_type": "llama", **SMALL}
    (tmp_path / "config.json").write_text(json.dumps(config))
    module = importlib.import_module("mlx_lm.models.llama")
    assert install(module.Model(module.ModelArgs.from_dict(config))) is None
    assert routing_shape(tmp_path) is None
