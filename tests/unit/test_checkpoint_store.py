"""training/store.py: a checkpoint's tinker:// path names a directory under the server's folder
only through ids and names it checks, so no path a client sends reaches the disk as given."""

from __future__ import annotations

from pathlib import Path

import pytest

from omlx_logprobs.training.checkpoint import CheckpointError
from omlx_logprobs.training.store import CheckpointStore, check_ttl

MODEL = "session-0123abcd:train:2"


def test_place_and_find(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    path, directory = store.place(MODEL, "step-10")
    assert path == f"tinker://{MODEL}/weights/step-10"
    assert directory == tmp_path / "session-0123abcd_train_2" / "weights" / "step-10"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        store.find(path)
    directory.mkdir(parents=True)
    assert store.find(path) == directory


@pytest.mark.parametrize(
    "path",
    [
        "/etc",
        "tinker://../../etc/weights/x",
        f"tinker://{MODEL}/weights/..",
        f"tinker://{MODEL}/weights/a/b",
        f"tinker://{MODEL}/sampler_weights/x",
        "tinker://session-1:train:0/../weights/x",
    ],
)
def test_other_paths_are_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint path"):
        CheckpointStore(str(tmp_path)).find(path)


@pytest.mark.parametrize("name", ["", "..", "a/b", ".hidden", "x" * 129, "a b"])
def test_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError, match="cannot name"):
        CheckpointStore(str(tmp_path)).place(MODEL, name)


def test_temporary_root() -> None:
    store = CheckpointStore(None)
    assert store.root.is_dir() and store.root == store.root


def test_listing_copy_and_remove(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    assert CheckpointStore(None).listing() == []  # nothing saved: no folder made to list
    assert CheckpointStore(str(tmp_path / "later")).listing() == []  # nor the folder made yet
    for kind, name in (("weights", "a"), ("external_weights", "b")):
        _, directory = store.place(MODEL, name, kind)
        directory.mkdir(parents=True)
        (directory / "adapters.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "not-a-run").mkdir()
    got = store.listing()
    assert {s.path for s in got} == {f"tinker://{MODEL}/weights/a",
                                     f"tinker://{MODEL}/external_weights/b"}  # fmt: skip
    assert [s.size_bytes for s in got] == [10, 10]
    assert store.listing("session-ff:train:0") == []
    external = store.saved(f"tinker://{MODEL}/external_weights/b")
    with pytest.raises(CheckpointError, match="no checkpoint path"):
        store.find(external.path)  # load_weights reads save_state's kind alone
    other = "session-ff:train:0"
    copied = store.copy(external, other)
    assert copied.path == f"tinker://{other}/external_weights/b"
    assert (copied.directory / "adapters.safetensors").read_bytes() == b"x" * 10
    with pytest.raises(CheckpointError, match="exists"):
        store.copy(external, other)
    store.remove(external)
    assert [s.path for s in store.listing(MODEL)] == [f"tinker://{MODEL}/weights/a"]


def test_a_time_to_live(tmp_path: Path) -> None:
    """A checkpoint given ttl_seconds is found and listed until its end, then gone for every
    lookup, its files removed; a copy takes a time to live of its own; saving over an expired
    name is saving anew. The bounds are Tinker's: an hour to ten years."""
    now = [1000.0]
    store = CheckpointStore(str(tmp_path), clock=lambda: now[0])
    path, directory = store.place(MODEL, "short")
    directory.mkdir(parents=True)
    (directory / "adapters.safetensors").write_bytes(b"x" * 10)
    store.expire_after(directory, 3600)
    saved = store.saved(path)
    assert saved.expires_at == 4600.0 and saved.size_bytes == 10  # the end is no weight
    copy = store.copy(saved, "session-0123abcd:train:3", None)
    assert copy.expires_at is None
    now[0] = 4599.0
    assert [s.path for s in store.listing(MODEL)] == [path]
    now[0] = 4600.0
    assert store.listing(MODEL) == [] and not directory.exists()
    with pytest.raises(CheckpointError, match="no checkpoint"):
        store.saved(path)
    assert store.saved(copy.path).directory.is_dir()  # the copy stays
    directory.mkdir(parents=True)
    store.expire_after(directory, 3600)
    now[0] = 9000.0
    assert not store.exists(directory)  # an expired one is no obstacle to a new save
    for ttl in (0, 3599, 10 * 365 * 86400 + 1):
        with pytest.raises(CheckpointError, match="between 3600"):
            check_ttl(ttl)
    check_ttl(None)
    check_ttl(3600)
