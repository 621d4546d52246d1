"""The parts of a model split over processes that one process can check: how a command is framed
into all-sum blocks, where rank 0's address comes from, which split a family gets, whether a
tensor split divides every dimension it cuts (and what is split instead), each rank's layers
in a pipeline, what rank 0's runner sends for a step, and the liveness link's verdicts. The
group itself runs in tests/integration/test_distributed.py."""

from __future__ import annotations

import importlib
import json
import pickle
import socket
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.distributed import layer_pipeline, liveness, shard_check
from omlx_logprobs.distributed.group import (
    BLOCK,
    Channel,
    RankInfo,
    backend_from_env,
    exchange_info,
)
from omlx_logprobs.distributed.sharded import SplitRefused, choose_mode, load_share
from tests.helpers.families import FAMILIES, ODD_HEADS, build_family

# DeepSeek-V3's multi-head latent attention: its query heads are cut, its KV heads are not.
DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 8,
    "q_lora_rank": None,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "qk_nope_head_dim": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
}


class FakeGroup:
    """What a split reads of its group before any forward: its size and this rank."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _net(model_type: str, **overrides: Any) -> Any:
    """A `model_type` model from its tiny config, random and lazy (no file)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {"model_type": model_type, **FAMILIES.get(model_type, {}), **overrides}
    return module.Model(module.ModelArgs.from_dict(config))


def framed(obj: object) -> tuple[object, list[int]]:
    """What a one-process group's channel sends for `obj`, read back as a follower would."""
    channel = Channel(mx.distributed.init())
    channel.send(obj, wait=True)
    raw = b"".join(np.array(a).tobytes() for a in channel._queued)
    n = int.from_bytes(raw[:8], "little")
    return pickle.loads(raw[8 : 8 + n]), [a.size for a in channel._queued]


def test_a_short_command_is_one_block_a_long_one_two() -> None:
    obj, sizes = framed(("ping", []))
    assert obj == ("ping", []) and sizes == [BLOCK // 4]
    prompt = np.arange(5000, dtype=np.int32)
    obj, sizes = framed(("step", (0, [(7, 0, 5000, (prompt, None, []), [7])]), []))
    assert isinstance(obj, tuple) and np.array_equal(obj[1][1][0][3][0], prompt)
    assert len(sizes) == 2 and sizes[0] == BLOCK // 4 and sizes[1] * 4 >= 20000 - BLOCK


def test_every_rank_record_comes_back() -> None:
    mine = RankInfo(0, "mac1", "layers 0-3 of 8 (pipeline parallel)", 12.5, 4321)
    assert exchange_info(mx.distributed.init(), mine) == [mine]


def test_rank0_address_from_each_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in ("NCCL_HOST_IP", "MLX_JACCL_COORDINATOR", "MLX_HOSTFILE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert liveness.rank0_address() is None and backend_from_env() == "any"
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5001"]]))
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert liveness.rank0_address() == "10.0.0.1" and backend_from_env() == "ring"
    monkeypatch.setenv("MLX_JACCL_COORDINATOR", "10.0.0.9:32323")
    assert liveness.rank0_address() == "10.0.0.9" and backend_from_env() == "jaccl"
    monkeypatch.setenv("NCCL_HOST_IP", "10.0.0.7")
    assert liveness.rank0_address() == "10.0.0.7" and backend_from_env() == "nccl"


def test_each_family_gets_the_split_it_has(tmp_path: Path, tokenizer_dir: Path) -> None:
    from mlx_lm.utils import load_model

    llama, _ = load_model(build_family("llama", tmp_path / "l", tokenizer_dir), lazy=True)
    nxt, _ = load_model(build_family("qwen3_next", tmp_path / "q", tokenizer_dir), lazy=True)
    gpt2, _ = load_model(build_family("gpt2", tmp_path / "g", tokenizer_dir), lazy=True)
    assert choose_mode(llama, "auto") == "tensor"
    assert choose_mode(llama, "pipeline") == "pipeline"  # the runner's own layer ranges
    assert choose_mode(nxt, "auto") == "pipeline"
    with pytest.raises(SplitRefused, match="no tensor parallelism"):
        choose_mode(nxt, "tensor")
    with pytest.raises(SplitRefused, match="neither by tensor nor by pipeline"):
        choose_mode(gpt2, "auto")


# (family, config fields other than its tiny config's, ranks, what the refusal names or None).
SPLITS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("llama", {}, 2, None),
    ("llama", ODD_HEADS, 2, "num_attention_heads (3) and num_key_value_heads (1) divisible by 2"),
    ("llama", {}, 4, "needs num_key_value_heads (2) divisible by 4"),
    ("qwen3_moe", {}, 2, None),
    # Experts' MLPs are cut by their columns: mlx refuses the slice, the field is named.
    ("qwen3_moe", {"moe_intermediate_size": 33}, 2, "moe_intermediate_size (33) divisible by 2"),
    ("gpt_oss", {"num_key_value_heads": 1}, 2, "needs num_key_value_heads (1) divisible by 2"),
    ("ministral3", {"num_key_value_heads": 3}, 2, "needs num_key_value_heads (3) divisible"),
    # A text config inside the model's: Qwen3.5's linear-attention heads are cut too.
    ("qwen3_5", {}, 2, None),
    ("qwen3_5", {}, 4, "linear_num_value_heads (2) and linear_num_key_heads (2) divisible by 4"),
    # Multi-head latent attention: the query heads are cut, the KV heads are not.
    ("deepseek_v3", DEEPSEEK_V3, 2, "needs num_attention_heads (3) divisible by 2"),
]


@pytest.mark.parametrize(("family", "overrides", "ranks", "want"), SPLITS)
def test_a_tensor_split_names_each_dimension_it_cannot_divide(
    family: str, overrides: dict[str, Any], ranks: int, want: str | None
) -> None:
    why = shard_check.shard(_net(family, **overrides), FakeGroup(ranks))
    if want is None:
        assert why is None
    else:
        assert why is not None and why.startswith(f"tensor parallel over {ranks} ranks needs ")
        assert want in why, why


def test_what_is_split_when_the_heads_do_not_divide(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Not asked: the layers, by the runner's own ranges (llama has no mlx-lm pipeline).
    Asked for the tensor split, or a family with no other: refused, naming the dimension."""
    odd = build_family("llama", tmp_path / "odd", tokenizer_dir, overrides=ODD_HEADS)
    share = load_share(odd, FakeGroup(2, 0))
    assert share.mode == "pipeline" and share.holds == "layers 1-1 of 2 (pipeline parallel)"
    assert len(share.net.layers) == 1
    share = load_share(odd, FakeGroup(2, 1), "pipeline")
    assert share.holds == "layers 0-0 of 2 (pipeline parallel)"
    with pytest.raises(SplitRefused) as err:
        load_share(odd, FakeGroup(2), "tensor")
    assert str(err.value) == (
        "tensor parallel over 2 ranks needs num_attention_heads (3) and num_key_value_heads (1)"
        " divisible by 2; --pipeline-parallel splits the layers instead"
    )
    gpt_oss = build_family(
        "gpt_oss", tmp_path / "gpt_oss", tokenizer_dir, overrides={"num_key_value_heads": 1}
    )
    with pytest.raises(SplitRefused) as err:
        load_share(gpt_oss, FakeGroup(2))  # no pipeline in mlx-lm, none of the runner's either
    assert "needs num_key_value_heads (1) divisible by 2" in str(err.value)
    assert "gpt_oss family cannot be split by layers" in str(err.value)
    # 1 KV head over 3 ranks: the layers then, but 2 layers cannot go to 3 ranks.
    with pytest.raises(SplitRefused, match=r"needs num_hidden_layers \(2\) of at least 3"):
        load_share(odd, FakeGroup(3))


def test_each_rank_holds_the_layers_mlx_lms_pipeline_would_give_it() -> None:
    assert layer_pipeline.ranges(30, 2) == [(15, 30), (0, 15)]
    assert layer_pipeline.ranges(5, 3) == [(3, 5), (1, 3), (0, 1)]
    for layers, size in ((7, 2), (7, 3), (8, 4)):
        for rank in range(size):
            net = _net("qwen2", num_hidden_layers=layers)
            net.model.pipeline(FakeGroup(size, rank))
            want = (net.model.start_idx, net.model.end_idx)
            assert layer_pipeline.ranges(layers, size)[rank] == want


def _listen() -> tuple[liveness.Listener, list[str], threading.Event]:
    lost: list[str] = []
    done = threading.Event()
    listener = liveness.Listener("127.0.0.1")

    def on_lost(why: str) -> None:
        lost.append(why)
        done.set()

    listener.start({1: "mac2"}, on_lost)
    return listener, lost, done


def test_a_closed_link_is_a_lost_rank_at_once() -> None:
    listener, lost, done = _listen()
    conn = socket.create_connection(("127.0.0.1", listener.port))
    conn.sendall((1).to_bytes(4, "little") + b"...")
    time.sleep(0.2)
    assert not lost
    t0 = time.monotonic()
    conn.close()
    assert done.wait(5) and time.monotonic() - t0 < 2
    assert lost == ["rank 1 on mac2 is gone (its process ended)"]
    listener.join(2)  # what rank 0's clean stop waits for: every link closed
    assert not any(t.is_alive() for t in listener._watchers)


def test_a_silent_link_is_a_lost_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "SILENT_S", 0.5)
    listener, lost, done = _listen()
    conn = socket.create_connection(("127.0.0.1", listener.port))
    conn.sendall((1).to_bytes(4, "little"))
    assert done.wait(5)
    assert "sent nothing for 0.5 s" in lost[0]
    conn.close()


def test_a_follower_beats_and_hears_rank0_go() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    gone = threading.Event()
    liveness.keep_alive("127.0.0.1", server.getsockname()[1], 3, lambda why: gone.set())
    conn, _ = server.accept()
    conn.settimeout(5)
    assert conn.recv(4) == (3).to_bytes(4, "little")
    assert conn.recv(1) == b"."
    conn.close()
    server.close()
    assert gone.wait(10)
