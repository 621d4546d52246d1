"""The disk tier under faults (runner/disk_tier.py): a corrupted file, a truncated one, one gone,
a full disk, a read-only folder and a process killed with SIGKILL while writing. Each is read as
a miss: the prompt is computed again, with the logprobs of the cache-off engine, the engine
serves on, and the files on disk stay within the size limit."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner import disk_tier
from omlx_logprobs.runner.disk_tier import DiskTier
from omlx_logprobs.runner.prefix_cache import BASE_KEY, Prefix, PrefixCache
from tests.engine.test_conversation_cache import Chat, cached, greedy
from tests.engine.test_disk_tier import seq
from tests.engine.test_prefix_cache import Maker
from tests.helpers.engine import Record, encode

ROOT = Path(__file__).resolve().parents[2]


def data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def flip(path: Path) -> None:
    """Corrupt a file in place: its middle bytes inverted, its length kept."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


@contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """A folder nothing can be written in or removed from, root included (chattr +i)."""
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i unavailable here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write fails as on a full disk."""

    def no_space(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(disk_tier, "_write_file", no_space)


# The tier alone: a failed read or write is a miss, and the entry is forgotten.


@pytest.mark.parametrize("damage", [flip, truncate, Path.unlink], ids=["flip", "cut", "gone"])
def test_a_damaged_file_is_a_miss(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "m")
    cache = PrefixCache(2 * 320, Maker(), disk)
    for start in (0, 100, 200):
        cache.keep(BASE_KEY, seq(start))
    disk.flush()
    [path] = data_files(tmp_path / "m")
    damage(path)
    ids = list(range(0, 40)) + [7, 7]
    assert cache.held(ids) == 40  # listed: found damaged only when read
    assert cache.longest(ids, len(ids) - 1) is None  # a miss: computed again
    assert disk.files == {} and disk.nbytes == 0
    disk.flush()
    assert list((tmp_path / "m").iterdir()) == []  # its files went
    cache.keep(BASE_KEY, seq(300))  # and the tier writes on
    disk.flush()
    assert len(disk.files) == 1 and on_disk(tmp_path / "m") == disk.nbytes


@pytest.mark.parametrize("damage", [flip, truncate], ids=["flip", "cut"])
def test_a_damaged_file_found_at_a_restart(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    """A file changed while no server ran: its length shows at the start, a flipped byte at the
    read; either way the restarted tier never returns its arrays."""
    disk = DiskTier(tmp_path, 1 << 20, "m")
    disk.put(seq(0))
    disk.put(seq(100))
    disk.flush()
    damaged, intact = data_files(tmp_path / "m")
    damage(damaged)
    again = DiskTier(tmp_path, 1 << 20, "m")
    loaded = [again.load(t) for _, t in list(again.files)]
    [kept] = [p for p in loaded if p is not None]
    assert np.array(kept.keys[0]).ravel().tolist() == list(kept.tokens)
    again.flush()
    assert data_files(tmp_path / "m") == [intact]


def test_a_meta_file_naming_other_tokens_is_dropped(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "m")
    disk.put(seq(0))
    disk.flush()
    [meta] = (tmp_path / "m").glob("*.json")
    meta.write_text(meta.read_text().replace("[0, 1,", "[1, 1,"))
    again = DiskTier(tmp_path, 1 << 20, "m")
    assert again.files == {} and list((tmp_path / "m").iterdir()) == []


def test_a_full_disk_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full_disk(monkeypatch)
    disk = DiskTier(tmp_path, 1 << 20, "m")
    cache = PrefixCache(2 * 320, Maker(), disk)
    for start in (0, 100, 200, 300):
        cache.keep(BASE_KEY, seq(start))
    ids = list(range(0, 40)) + [7, 7]
    assert cache.longest(ids, len(ids) - 1) is None  # its write failed: a miss
    disk.flush()
    assert disk.files == {} and disk.nbytes == 0
    assert list((tmp_path / "m").iterdir()) == []
    found = cache.longest(list(range(300, 342)), 41)  # memory serves on
    assert found is not None and found.tokens == tuple(range(300, 340))


def test_a_read_only_folder_is_read_and_not_written(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, "m")
    disk.put(seq(0))
    disk.flush()
    with read_only(tmp_path / "m"):
        again = DiskTier(tmp_path, 1 << 20, "m")
        prefix = again.load(tuple(range(40)))  # read, its use not recorded
        assert prefix is not None
        assert np.array(prefix.keys[0]).ravel().tolist() == list(range(40))
        again.put(seq(100))  # not written: forgotten once the write fails
        again.flush()
        assert list(again.files) == [(0, tuple(range(40)))]
        assert len(data_files(tmp_path / "m")) == 1
    with read_only(tmp_path):  # a folder that cannot be made
        with pytest.raises(OSError):
            DiskTier(tmp_path, 1 << 20, "other")


FILLER = """
import os
import sys
import mlx.core as mx
from omlx_logprobs.runner.disk_tier import DiskTier
from omlx_logprobs.runner.prefix_cache import Prefix

disk = DiskTier(sys.argv[1], 64 << 20, "m")  # a limit far above what the disk holds
for start in range(0, 12000, 1000):
    tokens = tuple(range(start, start + 256))
    column = mx.array(tokens, dtype=mx.float32).reshape(1, 1, 256, 1)
    kv = [mx.broadcast_to(column, (1, 2, 256, 128))]
    disk.put(Prefix(tokens, kv, kv))  # 512 KiB a file
disk.flush()
for _, tokens in list(disk.files):
    prefix = disk.load(tokens)
    assert prefix is not None and prefix.keys[0][0, 0, :, 0].tolist() == list(tokens)
print(len(disk.files), disk.nbytes, flush=True)
# No interpreter teardown (as in cli.py, _exit): destroying the stream threads of MLX at exit
# can abort the process after asynchronous evaluation (the script sits in single quotes).
os._exit(0)
"""


def test_a_real_full_disk(tmp_path: Path) -> None:
    """A 1 MiB tmpfs (a mount namespace of its own: root's, skipped elsewhere) under twelve
    512 KiB files: the writes past its end fail with ENOSPC, are logged (once: the rest within
    the minute are counted) and forgotten, and what was written reads back right."""
    folder = tmp_path / "small"
    folder.mkdir()
    mount = f"mount -t tmpfs -o size=1m tmpfs {folder} || exit 99"
    script = f"{mount}; {sys.executable} -c '{FILLER}' {folder}"
    try:
        run = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if run.returncode == 99 or run.stderr.startswith("unshare"):
        pytest.skip(f"no tmpfs of its own here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    listed, nbytes = map(int, run.stdout.split())
    assert 1 <= listed < 12 and nbytes <= 1 << 20
    assert run.stderr.count("No space left on device") == 1


# SIGKILL while writing: a process that writes without pause, killed; what it leaves.

WRITER = """
import sys
import mlx.core as mx
from omlx_logprobs.runner.disk_tier import DiskTier
from omlx_logprobs.runner.prefix_cache import Prefix

disk = DiskTier(sys.argv[1], 32 << 20, "m")
print("ready", flush=True)
for start in range(0, 1 << 30, 1000):
    n = 256
    tokens = tuple(range(start, start + n))
    kv = [mx.broadcast_to(mx.array(tokens, dtype=mx.float32).reshape(1, 1, n, 1), (1, 8, n, 1024))]
    disk.put(Prefix(tokens, kv, kv))
    if len(disk._pending) > 2:
        disk.flush()
"""


def killed_mid_write(folder: Path) -> int:
    """Start the writer, and SIGKILL it as soon as a temporary file shows after a whole one (or
    after 3 s); the files a write cut short left."""
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(folder.parent)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    until = time.monotonic() + 3
    for shows in ("*.json", "*.tmp"):  # one whole file first, then a write under way
        while time.monotonic() < until and not any(folder.glob(shows)):
            pass
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    names = {f.name.split(".")[0] for f in folder.iterdir()}
    metas = {f.stem for f in folder.glob("*.json")}
    return len(list(folder.glob("*.tmp"))) + len(names - metas)


def test_sigkill_while_writing_leaves_nothing_wrong(tmp_path: Path) -> None:
    """Killed mid-write (8 MiB files, a 32 MiB limit), again and again: at each restart every
    listed file reads back the tokens it was written for, no temporary or unlisted file stays,
    and the files stay within the limit."""
    folder, left = tmp_path / "m", 0
    for _ in range(4):
        left += killed_mid_write(folder)
        again = DiskTier(tmp_path, 32 << 20, "m")
        assert again.files, "nothing written before the kill"
        for _, tokens in list(again.files):
            prefix = again.load(tokens)
            assert prefix is not None
            assert np.array(prefix.keys[0][0, 0, :, 0]).tolist() == list(tokens)
        again.flush()
        assert all(f.suffix in (".json", ".safetensors") for f in folder.iterdir())
        assert on_disk(folder) == again.nbytes <= 32 << 20
    assert left > 0, "no kill landed within a write"


# The engine: a fault on disk gives the cache-off engine's tokens and logprobs, and it serves on.


def conversation(tiny: LoadedModel, cfg: EngineConfig) -> tuple[list[int], list[int]]:
    """Turn one on an engine that then shuts down (its sequences to disk); turn two's prompt."""
    prompt = encode(tiny, "A long system turn for the disk. " * 8 + "User: hi\n")
    first = Chat(tiny, cfg)
    [r] = first.send([prompt], greedy(10))
    first.client.shutdown()
    return prompt, prompt + list(r.output_ids) + encode(tiny, "\nUser: more\n")


def same_as_cache_off(tiny: LoadedModel, turn: list[int], got: Record) -> None:
    off = Chat(tiny, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    try:
        [want] = off.send([turn], greedy(8))
    finally:
        off.client.shutdown()
    assert list(got.output_ids) == list(want.output_ids)
    assert got.store is not None and want.store is not None
    np.testing.assert_allclose(got.store.logprobs, want.store.logprobs, atol=1e-4)


def second_turn(
    tiny: LoadedModel, cfg: EngineConfig, turn: list[int], before: Callable[[], None]
) -> Record:
    """Turn two on a new engine (`before` runs once it has read the folder), then again on the
    same engine: the second time from memory."""
    chat = Chat(tiny, cfg)
    try:
        before()
        [got] = chat.send([turn], greedy(8))
        [again] = chat.send([turn], greedy(8))
    finally:
        chat.client.shutdown()
    assert cached(again) == len(turn) - 1
    assert list(again.output_ids) == list(got.output_ids)
    return got


@pytest.mark.parametrize("damage", [flip, truncate, Path.unlink], ids=["flip", "cut", "gone"])
def test_a_damaged_file_is_computed_again(
    tiny: LoadedModel, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64, kv_cache_dir=str(tmp_path))
    _, turn = conversation(tiny, cfg)
    [folder] = tmp_path.iterdir()
    [path] = data_files(folder)
    got = second_turn(tiny, cfg, turn, lambda: damage(path))
    assert cached(got) == 0
    same_as_cache_off(tiny, turn, got)


def test_a_full_disk_is_computed_again(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full_disk(monkeypatch)
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64, kv_cache_dir=str(tmp_path))
    _, turn = conversation(tiny, cfg)  # its shutdown's writes fail
    [folder] = tmp_path.iterdir()
    assert list(folder.iterdir()) == []
    got = second_turn(tiny, cfg, turn, lambda: None)
    assert cached(got) == 0
    same_as_cache_off(tiny, turn, got)


def test_a_read_only_folder_serves_what_it_holds(tiny: LoadedModel, tmp_path: Path) -> None:
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64, kv_cache_dir=str(tmp_path))
    prompt, turn = conversation(tiny, cfg)
    [folder] = tmp_path.iterdir()
    with read_only(folder):
        got = second_turn(tiny, cfg, turn, lambda: None)  # its shutdown's writes fail
    assert cached(got) > len(prompt)
    same_as_cache_off(tiny, turn, got)
    with read_only(tmp_path):  # no folder of its own can be made: memory alone
        fresh = Chat(tiny, EngineConfig(prefill_chunk=64, prefix_cache_mib=64,
                                        kv_cache_dir=str(tmp_path / "new")))  # fmt: skip
        try:
            [r] = fresh.send([turn], greedy(8))
        finally:
            fresh.client.shutdown()
    same_as_cache_off(tiny, turn, r)


def test_keys_read_back_equal_those_written(tmp_path: Path) -> None:
    """bfloat16 keys survive the write and the checks unchanged (the served models' dtype)."""
    kv = [mx.random.normal((1, 2, 40, 8)).astype(mx.bfloat16)]
    disk = DiskTier(tmp_path, 1 << 20, "m")
    disk.put(Prefix(tuple(range(40)), kv, kv))
    disk.flush()
    prefix = DiskTier(tmp_path, 1 << 20, "m").load(tuple(range(40)))
    assert prefix is not None and prefix.keys[0].dtype == mx.bfloat16
    assert mx.array_equal(prefix.keys[0], kv[0]).item()


def test_a_full_disk_logs_its_failures_at_most_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every eviction of a full disk's tier fails its write: the first is logged, the rest
    counted into the next warning, not a line each."""
    full_disk(monkeypatch)
    disk = DiskTier(tmp_path, 1 << 20, "m")
    with caplog.at_level(logging.WARNING, logger="omlx_logprobs"):
        for start in range(0, 1000, 100):
            disk.put(seq(start))
        disk.flush()
        [first] = caplog.records
        assert "40 tokens not written" in first.getMessage()
        monkeypatch.setattr(disk_tier, "WARN_EVERY_S", 0.0)
        disk.put(seq(2000))
        disk.flush()
    assert len(caplog.records) == 2
    assert caplog.records[1].getMessage().endswith("(9 more since the last)")
