"""Who may call and what a request may reach: loopback by default, the optional API key on every
route but /health, CORS only when configured, and no request field that names a file or a
template."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from omlx_logprobs.config import Access, ServerConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.options import build_parser
from omlx_logprobs.serve_config import config_from_args
from tests.helpers.server import TINY_NAME, assert_openai_error, thread_server

KEY = "sk-test-0123456789abcdef"
CHAT = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def locked(tiny_served: LoadedModel) -> Iterator[str]:
    access = Access(api_key=KEY, allowed_origins=("https://app.example",))
    with thread_server(tiny_served, access=access) as (base, _):
        yield base


@pytest.fixture(scope="module")
def open_server(tiny_served: LoadedModel) -> Iterator[str]:
    with thread_server(tiny_served) as (base, _):
        yield base


def test_binds_loopback_by_default() -> None:
    args = build_parser().parse_args(["serve"])
    cfg = config_from_args(args)
    assert cfg.host == ServerConfig().host == "127.0.0.1"
    assert cfg.access.api_key is None and cfg.access.allowed_origins == ()


def test_cli_rejects_out_of_range_limits() -> None:
    with pytest.raises(SystemExit):
        from omlx_logprobs.cli import main

        main(["serve", "--max-n", "0"])


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None),
        ("GET", "/openapi.json", None),
        ("GET", "/no/such/route", None),
    ],
)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", f"bearer{KEY}"]
)
def test_api_key_required(locked: str, method: str, path: str, body: Any, auth: str | None) -> None:
    headers = {"authorization": auth} if auth else {}
    r = httpx.request(method, locked + path, json=body, headers=headers, timeout=30)
    err = assert_openai_error(r, 401, None)
    assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_api_key_accepted_and_health_open(locked: str) -> None:
    assert httpx.get(locked + "/health").status_code == 200  # probes need no key
    client = openai.OpenAI(base_url=locked + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.create(**CHAT)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list().data] == [TINY_NAME]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked + "/v1", api_key="nope", max_retries=0).models.list()


def test_cors_only_when_configured(locked: str, open_server: str) -> None:
    pre = {"origin": "https://app.example", "access-control-request-method": "POST"}
    r = httpx.options(locked + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(locked + "/v1/models", headers={**pre, "origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    r = httpx.get(open_server + "/v1/models", headers={"origin": "https://app.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(open_server + "/v1/chat/completions", headers=pre)
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize(
    "model",
    ["/etc/passwd", "../../tiny", "tiny/../tiny", "TINY", " tiny", "", "~/.cache/omlx_logprobs"],
)
def test_only_the_served_model_can_be_named(open_server: str, model: str) -> None:
    r = httpx.post(open_server + "/v1/chat/completions", json={**CHAT, "model": model})
    assert_openai_error(r, 404, "model")


@pytest.mark.parametrize(
    "key", ["chat_template", "tokenize", "return_dict", "tools", "tokenizer_kwargs"]
)
def test_template_kwargs_cannot_replace_template_parameters(open_server: str, key: str) -> None:
    evil = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
    body = {**CHAT, "chat_template_kwargs": {key: evil if key == "chat_template" else True}}
    r = httpx.post(open_server + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(r, 400, "chat_template_kwargs")


def test_template_kwargs_reach_the_template_as_variables(open_server: str) -> None:
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(open_server + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_request_handling_reaches_no_shell_file_or_eval() -> None:
    """Static: the HTTP layer imports nothing that runs commands or opens files, and nothing in
    the package evaluates code (files are opened only when loading models and by the disk tier,
    by the Batch API's folder, batchdir/, and by training/'s checkpoints under --tinker-dir,
    under names it makes and checks: training/store.py). One module of the HTTP layer reads
    files: api/core/images.py, an image a request names by path, only with
    --allowed-local-media-path and only under it once resolved (vLLM's flag)."""
    import ast
    from pathlib import Path

    import omlx_logprobs

    root = Path(omlx_logprobs.__file__).parent
    forbidden_imports = {"os", "subprocess", "pathlib", "ctypes", "shutil", "pickle"}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        where = path.relative_to(root).parts
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "compile"), path
                # Files are opened where models load, and by the disk tier in the folder the
                # operator named (--kv-cache-dir), under names it derives from token hashes, and
                # by batchdir/ in the folder the operator named (--batch-dir), under ids it makes
                opener = where[0] in ("models", "batchdir") or where == ("runner", "disk_tier.py")
                assert node.func.id != "open" or opener, path
            media = where == ("api", "core", "images.py")  # pathlib: a file under the root only
            if where[0] == "api" and not media and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                assert not {n.split(".")[0] for n in names} & forbidden_imports, (path, names)
