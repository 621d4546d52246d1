"""The prefix cache's disk tier (`--kv-cache-dir`, runner/disk_tier.py): what the memory budget
evicts is written to disk and loaded back on a hit; at shutdown what memory holds is written too,
and a restarted engine on the same weights continues the conversation from disk (equal to the
cache-off engine), while a changed model never reads it; the size limit drops the least
recently used files."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.runner.disk_tier import DiskTier, fingerprint
from omlx_logprobs.runner.prefix_cache import BASE_KEY, Prefix, PrefixCache
from omlx_logprobs.types import cache_namespace
from tests.engine.test_conversation_cache import Chat, cached, greedy
from tests.engine.test_prefix_cache import Maker
from tests.helpers.engine import check_against_reference, encode


def seq(start: int, n: int = 40) -> Prefix:
    """A sequence whose keys hold its tokens (so a load shows what it read), 320 bytes."""
    tokens = list(range(start, start + n))
    kv = [mx.array(tokens, dtype=mx.float32).reshape(1, 1, n, 1)]
    return Prefix(tuple(tokens), kv, kv)


def test_evicted_sequences_come_back_from_disk(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "model-a")
    cache = PrefixCache(2 * 320, Maker(), disk)
    for start in (0, 100, 200):
        cache.keep(BASE_KEY, seq(start))
    assert len(cache.entries) == 2 and len(disk.files) == 1  # the first went to disk
    disk.flush()
    assert sorted(p.suffix for p in (tmp_path / "model-a").iterdir()) == [".json", ".safetensors"]
    ids = list(range(0, 40)) + [7, 7]
    assert cache.held(ids) == 40  # a look at what disk holds, nothing loaded
    found = cache.longest(ids, len(ids) - 1)
    assert found is not None and found.tokens == tuple(range(40))
    assert np.array(found.keys[0]).ravel().tolist() == list(range(40))
    assert (BASE_KEY, tuple(range(40))) in cache.entries  # back in memory
    assert (disk.hits, disk.hit_tokens) == (1, 40)  # /metrics' count: the load, not the look


def test_namespaces_stay_apart_on_disk(tmp_path: Path) -> None:
    """Sequences of a cache_salt's namespace go to disk and come back for that namespace only,
    after a restart too; their files hold the salt's hash, never the salt."""
    a, b = cache_namespace("salt-a"), cache_namespace("salt-b")
    disk = DiskTier(tmp_path, 1 << 20, "m")
    cache = PrefixCache(320, Maker(), disk)
    cache.keep((0, 0, a), seq(0))
    cache.keep((0, 0, b), seq(100))  # past the budget: a's goes to disk
    cache.keep(BASE_KEY, seq(0))  # the same tokens in the default namespace: b's goes
    disk.flush()
    assert sorted(disk.files) == [(a, tuple(range(40))), (b, tuple(range(100, 140)))]
    again = PrefixCache(1 << 20, Maker(), DiskTier(tmp_path, 1 << 20, "m"))  # a restart
    ids = list(range(0, 40)) + [7, 7]
    assert again.held(ids) == 0 and again.held(ids, (0, 0, b)) == 0
    found = again.longest(ids, len(ids) - 1, (0, 0, a))
    assert found is not None and np.array(found.keys[0]).ravel().tolist() == list(range(40))
    assert again.held(list(range(100, 142)), (0, 0, b)) == 40
    assert again.held(list(range(100, 142)), (0, 0, a)) == 0
    text = "".join(p.read_text() for p in (tmp_path / "m").glob("*.json"))
    assert "salt" not in text and str(a) in text


def written(tmp_path: Path, prefix: Prefix) -> int:
    """The bytes a sequence takes on disk: its data file and its meta file."""
    one = DiskTier(tmp_path / "one", 1 << 20, "m")
    one.put(prefix)
    one.flush()
    return one.nbytes


def test_the_size_limit_drops_the_least_recently_used(tmp_path: Path) -> None:
    limit = 2 * written(tmp_path, seq(200)) + 10  # two files, not three
    disk = DiskTier(tmp_path, limit, "m")
    for start in (0, 100, 200):
        disk.put(seq(start))
    disk.flush()
    assert [t[0] for _, t in disk.files] == [100, 200]
    assert len(list((tmp_path / "m").glob("*.safetensors"))) == 2
    on_disk = sum(p.stat().st_size for p in (tmp_path / "m").iterdir())
    assert on_disk == disk.nbytes <= limit  # the limit counts what the files take
    again = DiskTier(tmp_path, limit, "m")  # what a restart finds
    assert [t[0] for _, t in again.files] == [100, 200]
    assert again.find(list(range(200, 260)), 59) == (tuple(range(200, 240)), 40)


def test_a_restart_continues_the_conversation_from_disk(tiny_dir: Path, tmp_path: Path) -> None:
    """Turn one on an engine that then shuts down; turn two on a new engine (the same weights,
    loaded again) starts from what the first wrote, with the answer of the cache-off engine; a
    model whose weights differ finds nothing."""
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64, kv_cache_dir=str(tmp_path))
    model = load_model(str(tiny_dir))
    prompt = encode(model, "A long system turn for the disk. " * 8 + "User: hi\n")
    first = Chat(model, cfg)
    [r] = first.send([prompt], greedy(10))
    first.client.shutdown()
    turn = prompt + list(r.output_ids) + encode(model, "\nUser: more\n")
    again = Chat(load_model(str(tiny_dir)), cfg)
    off = Chat(model, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    try:
        [got] = again.send([turn], greedy(8))
        tallies = again.client.snapshot().tallies  # what /metrics reads
        [want] = off.send([turn], greedy(8))
    finally:
        again.client.shutdown()
        off.client.shutdown()
    assert cached(got) == len(prompt) + len(r.output_ids) - 1
    assert tallies.disk_hits == 1 and tallies.disk_hit_tokens >= cached(got)
    assert list(got.output_ids) == list(want.output_ids)
    check_against_reference(model, turn, got, 3)  # and a full forward pass
    assert got.store is not None and want.store is not None
    np.testing.assert_allclose(got.store.logprobs, want.store.logprobs, atol=1e-4)
    other = load_model(str(tiny_dir))
    w = other.model.model.layers[0].mlp.down_proj.weight
    other.model.model.layers[0].mlp.down_proj.weight = w * 1.01
    assert fingerprint(other.model) != fingerprint(model.model)
    changed = Chat(other, cfg)
    try:
        [c] = changed.send([turn], greedy(2))
    finally:
        changed.client.shutdown()
    assert cached(c) == 0
