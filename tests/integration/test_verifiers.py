"""`verifiers` (pinned on PyPI, in a venv of its own: its releases need openai<3, which the agent
frameworks here cannot share; `make verifiers-venv` builds it, `make test` first) run unmodified
against the real server: a single-turn environment and a multi-turn one with a tool, through
its classic token client (/v1/chat/completions, then /tokenize and
/v1/chat/completions/tokens), and the tool one through its renderer client (verifiers v1's and
prime-rl's path: it renders itself and posts ids to /inference/v1/generate). The ids and
logprobs it collects for training equal a float32 forward of the same tokens (1e-4). The model
is a scripted one that calls `get_weather` when asked "Case: weather" and answers after the
tool's result, with a Hermes (Qwen 2.5) template."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import reference_logprobs
from tests.helpers.scripted import write_description
from tests.helpers.server import thread_server
from tests.integration.test_frameworks import SCRIPTS
from tests.integration.test_tool_calls import TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
DRIVER = ROOT / "tests" / "verifiers_driver" / "run.py"

pytestmark = pytest.mark.skipif(
    not PYTHON.exists(), reason="no verifiers venv (make verifiers-venv)"
)


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LoadedModel, Path]]:
    path = tmp_path_factory.mktemp("vf") / "agent.json"
    desc = write_description(
        path, name="scripted-agent", added_tokens=["<tool_call>", "</tool_call>"],
        scripts=SCRIPTS,
    )  # fmt: skip
    model = load_model(str(desc))
    model.tokenizer.chat_template = TEMPLATE
    # the tokenizer as a directory, for the clients that render themselves
    tok_dir = tmp_path_factory.mktemp("vf_tokenizer")
    model.tokenizer.save_pretrained(str(tok_dir))
    with thread_server(model, tool_format="hermes") as (url, _):
        yield url, model, tok_dir


def run_verifiers(url: str, model: LoadedModel, tok_dir: Path, *extra: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(PYTHON), str(DRIVER), url, model.name, str(tok_dir), *extra],
        capture_output=True, text=True, timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def check_steps(model: LoadedModel, steps: list[dict[str, Any]]) -> None:
    """Each turn's completion ids and logprobs, as verifiers keeps them for the trainer, against
    one full forward of that turn's prompt and completion."""
    for step in steps:
        prompt, out, lps = step["prompt_ids"], step["completion_ids"], step["completion_logprobs"]
        assert out and len(lps) == len(out), step
        ref = reference_logprobs(model, prompt + out)[len(prompt) - 1 : -1]
        for i, tok in enumerate(out):
            assert abs(lps[i] - ref[i][tok]) < 1e-4, (i, lps[i], ref[i][tok])


def test_verifiers_token_client(agent: tuple[str, LoadedModel, Path]) -> None:
    url, model, tok_dir = agent
    got = run_verifiers(url, model, tok_dir)
    single, tools = got["single_turn"], got["tool_turns"]
    assert single["error"] is None and len(single["steps"]) == 1
    check_steps(model, single["steps"])
    # a call, then the answer after the tool's result: the second turn's prompt is the first
    # turn's prompt and completion as the client holds them, then the tool's turn
    assert tools["error"] is None and len(tools["steps"]) == 2, tools
    first, second = tools["steps"]
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(first["completion_ids"])] == (
        first["prompt_ids"] + first["completion_ids"]
    )
    check_steps(model, tools["steps"])
    assert single["paths"] == ["/v1/chat/completions"]
    assert tools["paths"][0] == "/v1/chat/completions" and "/tokenize" in tools["paths"]
    assert tools["paths"][-1] == "/v1/chat/completions/tokens"


def test_verifiers_renderer_client(agent: tuple[str, LoadedModel, Path]) -> None:
    """The renderer client (verifiers' v1 path, prime-rl's): it renders with the model's
    tokenizer itself, checks `max_model_len` in /v1/models, and posts ids to
    /inference/v1/generate; the same tool environment, the same checks."""
    url, model, tok_dir = agent
    got = run_verifiers(url, model, tok_dir, "renderer")["renderer"]
    assert got["error"] is None and len(got["steps"]) == 2, got
    assert got["paths"] == ["/v1/models", "/inference/v1/generate", "/inference/v1/generate"]
    check_steps(model, got["steps"])


def test_verifiers_sends_cache_salt_and_priority(agent: tuple[str, LoadedModel, Path]) -> None:
    """`cache_salt` and `priority` in verifiers' sampling args (`extra_body`, as prime-rl's
    pipeline RL sets them): the renderer client lifts them into each /inference/v1/generate
    body, the token client sends them with each chat request; the server takes them (no
    400s), and the salt keeps the cache apart: the tool rollout under salt a, then b (its
    first prompt the same tokens, none of them cached), then a again (all of them but the last
    cached); each rollout's second turn continues its first from the cache."""
    url, model, tok_dir = agent
    runs = run_verifiers(url, model, tok_dir, "salted")["salted"]
    for run, salt in zip(runs, "abac"):
        assert run["error"] is None and len(run["steps"]) == 2, run
        check_steps(model, run["steps"])
        posted = [c for c in run["calls"] if c["path"] != "/tokenize"]
        assert posted and all(c["cache_salt"] == salt and c["priority"] == -2 for c in posted)
    renderer = runs[:3]
    for run in renderer:
        assert [c["path"] for c in run["calls"]] == ["/inference/v1/generate"] * 2
    first_prompt = renderer[0]["steps"][0]["prompt_ids"]
    assert all(run["steps"][0]["prompt_ids"] == first_prompt for run in renderer)
    firsts = [run["calls"][0]["cached_tokens"] for run in renderer]
    assert firsts == [0, 0, len(first_prompt) - 1]
    for run in runs:
        first, second = run["steps"]
        assert run["calls"][-1]["cached_tokens"] >= len(first["prompt_ids"])
        assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    assert [c["path"] for c in runs[3]["calls"]][-1] == "/v1/chat/completions/tokens"
