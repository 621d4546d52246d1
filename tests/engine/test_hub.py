"""Hugging Face names: the local cache first (huggingface_hub's layout, built here), a download
only when allowed. No test touches the network: the download function of models/hub.py is
replaced by one that fills the cache from a local directory, driving the same progress class."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_logprobs.models import hub
from omlx_logprobs.models.loader import load_model, resolve_model_path
from tests.helpers.hub_cache import REVISION, write_cached_repo

REPO = "test-org/tiny-llama"


@pytest.fixture
def hub_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache in HF_HUB_CACHE, downloads allowed by the environment, and
    a download function that fails the test if anything reaches it."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def no_network(repo_id: str, cache: Path) -> str:
        raise AssertionError(f"tried to download {repo_id}")

    monkeypatch.setattr(hub, "download", no_network)
    return cache


def test_cached_model_resolves_without_download(hub_env: Path, tiny_dir: Path) -> None:
    snapshot = write_cached_repo(hub_env, REPO, tiny_dir)
    path, name = resolve_model_path(REPO)
    assert path == snapshot and path.name == REVISION and name == REPO
    model = load_model(REPO)
    assert model.name == REPO and model.path == snapshot
    assert len(model.vocab) == 49152


def test_hf_home_is_honoured(
    hub_env: Path, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = write_cached_repo(tmp_path / "home" / "hub", REPO, tiny_dir)
    assert resolve_model_path(REPO)[0] == snapshot


def test_local_directory_wins_over_a_hub_name(
    hub_env: Path, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = tmp_path / "work"
    (local / "test-org").mkdir(parents=True)
    (local / "test-org" / "tiny-llama").symlink_to(tiny_dir)
    monkeypatch.chdir(local)
    path, name = resolve_model_path(REPO)
    assert path.resolve() == tiny_dir.resolve() and name == "tiny-llama"


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_offline_refuses_a_missing_repository(
    how: str, hub_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "environment":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        resolve_model_path("test-org/not-cached", offline=how == "flag")
    message = str(e.value)
    assert "test-org/not-cached" in message and "is not in the cache" in message
    assert str(hub_env) in message and "--offline or HF_HUB_OFFLINE=1" in message


def test_offline_refuses_a_partial_snapshot(hub_env: Path, tiny_dir: Path) -> None:
    write_cached_repo(hub_env, REPO, tiny_dir, only=["config.json"])
    with pytest.raises(FileNotFoundError, match="is only partly in the cache"):
        resolve_model_path(REPO, offline=True)


def test_online_downloads_into_the_cache_with_progress(
    hub_env: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def fake_download(repo_id: str, cache: Path) -> str:
        """What huggingface_hub's snapshot download leaves: the cache layout, and progress
        reported through the tqdm class we give it."""
        calls.append((repo_id, cache))
        files = sorted(f for f in tiny_dir.iterdir() if f.is_file())
        total = sum(f.stat().st_size for f in files)
        with hub.LogProgress(total=total, unit="B", unit_scale=True, desc="Downloading") as bar:
            for f in files:
                bar.update(f.stat().st_size)
        return str(write_cached_repo(cache, repo_id, tiny_dir))

    monkeypatch.setattr(hub, "download", fake_download)
    with caplog.at_level(logging.INFO, logger="omlx_logprobs"):
        path, name = resolve_model_path(REPO)
    assert calls == [(REPO, hub_env)] and name == REPO
    assert (path / "config.json").is_file()
    assert f"downloading {REPO} from the Hugging Face Hub" in caplog.text
    assert "download: " in caplog.text and "100%" in caplog.text  # the progress, as log lines
    # Then the cache answers: no second download.
    assert resolve_model_path(REPO)[0] == path and len(calls) == 1


def test_repository_without_a_model_is_refused(
    hub_env: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gguf_only(repo_id: str, cache: Path) -> str:
        return str(write_cached_repo(cache, repo_id, tiny_dir, only=["tokenizer.json"]))

    monkeypatch.setattr(hub, "download", gguf_only)
    with pytest.raises(FileNotFoundError, match="not an mlx-lm model"):
        resolve_model_path(REPO)


def test_cli_offline_error_names_the_repository(hub_env: Path) -> None:
    """`serve --offline` with a repository that is not cached: a one-line error, exit 2."""
    r = subprocess.run(
        [sys.executable, "-m", "omlx_logprobs.cli", "serve", "--offline",
         "--model", "test-org/not-cached"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "test-org/not-cached" in r.stderr and "Traceback" not in r.stderr
