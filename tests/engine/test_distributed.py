"""The parts of a model split over processes that one process can check: how a command is framed
into all-sum blocks, where rank 0's address comes from, which split a family gets, what rank 0's
runner sends for a step, and the liveness link's verdicts. The group itself runs in
tests/integration/test_distributed.py."""

from __future__ import annotations

import json
import pickle
import socket
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.engine import liveness
from omlx_logprobs.engine.group import (
    BLOCK,
    Channel,
    RankInfo,
    backend_from_env,
    exchange_info,
)
from omlx_logprobs.models.sharded import choose_mode
from tests.helpers.families import build_family


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
    assert choose_mode(nxt, "auto") == "pipeline"
    with pytest.raises(ValueError, match="no tensor parallelism"):
        choose_mode(nxt, "tensor")
    with pytest.raises(ValueError, match="neither by tensor nor by pipeline"):
        choose_mode(gpt2, "auto")


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
