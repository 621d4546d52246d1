"""A 4-bit quantized directory (mlx-lm's convert of the tiny model) served by name from a Hugging
Face cache built here, offline, through the real server and the `openai` client: its logprobs
equal mlx-lm's own forward of that directory (float32 activations on the CPU, as `auto`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.engine.test_quantized import KINDS, _mlx_lm_logprobs, convert
from tests.helpers.engine import completion_difference
from tests.helpers.hub_cache import write_cached_repo
from tests.helpers.server import ServerProcess, server_process

REPO = "test-org/tiny-4bit"
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2, 198, 1, 4093, 198, 1780, 314, 1]


@pytest.fixture(scope="module")
def quantized_4bit(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert(tiny_dir, tmp_path_factory.mktemp("q4") / "model", *KINDS["4bit"])


@pytest.fixture(scope="module")
def served(
    quantized_4bit: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    cache = tmp_path_factory.mktemp("hf-cache")
    write_cached_repo(cache, REPO, quantized_4bit)
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_CACHE", str(cache))
    mp.setenv("HF_HUB_OFFLINE", "1")
    try:
        with server_process(["--model", REPO, "--log-level", "info"]) as s:
            yield s
    finally:
        mp.undo()


def test_quantized_logprobs_through_the_server(served: ServerProcess, quantized_4bit: Path) -> None:
    client = openai.OpenAI(base_url=served.base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [REPO]
    r = client.completions.create(
        model=REPO,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=5,
        extra_body={"prompt_logprobs": 5, "return_token_ids": True, "ignore_eos": True},
    )
    c = r.choices[0]
    ref = _mlx_lm_logprobs(quantized_4bit, PROMPT + c.model_extra["token_ids"])
    assert completion_difference(c, PROMPT, ref) < 1e-4
    assert "dequantized to float32 at load" in served.log()
    assert f"model {REPO} from the Hugging Face cache" in served.log()
