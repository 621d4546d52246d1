"""A model split over two processes (distributed/distributed.py): `omlx-logprobs serve` under
`mlx.launch -n 2 --backend ring` on loopback, through the `openai` client, against the same
model served by one process. Every token and every logprob (sampled, top lists, prompt
logprobs, echo, streamed) and every embedding equals the one-process server's within 1e-4
(float32), with the requests batched together, an aborted stream beside them, and n > 1.
Tensor parallel on a llama, pipeline parallel on qwen3_next (a family mlx-lm splits only by
layers) and on a llama whose heads do not divide over two ranks (the runner's own layer
ranges; forced to split its heads, it is refused at start-up on both ranks, naming them). A
rank killed mid-stream fails the stream with an error naming the group, /health turns 503, and
the next request fails at once. Asleep, a split model releases its caches (level 1); level 2,
which would drop every rank's weights, is a 400 naming `level` that leaves it serving."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.families import ODD_HEADS, build_family
from tests.helpers.group import MLX_LAUNCH, group_server, run_to_exit
from tests.helpers.server import assert_openai_error, server_process, wait_idle

pytestmark = pytest.mark.skipif(not MLX_LAUNCH.exists(), reason="mlx.launch is not installed")

TOLERANCE = 1e-4
# --task embed: embedding prompts (prefill only, the body's hidden state) in the steps too
ARGS = ["--max-num-seqs", "16", "--prefill-chunk", "48", "--task", "embed", "--log-level", "info"]
QUESTIONS = ["Tell me about cats.", "What is two plus two?", "Name a colour."]


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(r: Any) -> list[Any]:
    return [
        [
            (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in c.logprobs.content
        ]
        for c in r.choices
    ]


def _completion(r: Any) -> list[Any]:
    out = []
    for c in r.choices:
        lp = c.logprobs
        out.append(
            [lp.tokens, lp.token_logprobs, lp.top_logprobs, c.model_extra.get("prompt_logprobs")]
        )
    return out


def _stream(client: openai.OpenAI, name: str) -> list[Any]:
    entries = []
    for chunk in client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": QUESTIONS[2]}],
        max_tokens=14,
        temperature=0.7,
        seed=3,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                entries += [
                    (e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                    for e in c.logprobs.content
                ]
    return entries


def workload(base: str, name: str) -> list[Any]:
    """Greedy and seeded chat with top lists (n = 2 among them), completions with echo and
    with prompt logprobs, and a streamed chat, sent together so that they share steps."""
    client = _client(base)

    def chat(i: int) -> list[Any]:
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": QUESTIONS[i % 3]}],
            max_tokens=8 + 3 * i,
            temperature=0.0 if i % 2 == 0 else 0.9,
            seed=11 + i,
            n=2 if i == 1 else 1,
            logprobs=True,
            top_logprobs=5,
        )
        return _chat(r)

    def echo() -> list[Any]:
        r = client.completions.create(
            model=name,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            logprobs=3,
            echo=True,
        )
        return _completion(r)

    def prompt_only() -> list[Any]:
        r = client.completions.create(
            model=name, prompt="Score this prompt only", max_tokens=0, logprobs=2, echo=True
        )
        return _completion(r)

    def scored() -> list[Any]:
        r = client.completions.create(
            model=name,
            # Over 1024 tokens: the command that carries it takes a second block (4 KiB first).
            prompt="One two three four five six seven eight nine ten eleven twelve " * 90,
            max_tokens=3,
            temperature=0,
            logprobs=2,
            extra_body={"prompt_logprobs": 3},
        )
        return _completion(r)

    def embeddings() -> list[Any]:
        texts = [QUESTIONS[0], "Embed this longer text, " * 12]  # the second one chunked
        r = client.embeddings.create(model=name, input=texts, encoding_format="float")
        return [d.embedding for d in r.data]

    calls = [lambda i=i: chat(i) for i in range(4)]
    calls += [echo, prompt_only, scored, embeddings, lambda: _stream(client, name)]
    with ThreadPoolExecutor(len(calls)) as ex:
        return list(ex.map(lambda f: f(), calls))


def assert_close(a: Any, b: Any, where: str = "") -> None:
    """Same structure, same tokens, numbers within TOLERANCE."""
    if where.endswith(".rank") and isinstance(a, int):
        # A rank counts the vocabulary's logits above the token's: logits within float32
        # rounding of it (the sums of a split forward run in another order) may move it by one.
        assert abs(a - b) <= 2, f"{where}: {a} vs {b}"
    elif isinstance(a, float) or isinstance(b, float):
        assert a is not None and b is not None, where
        assert abs(a - b) <= TOLERANCE, f"{where}: {a} vs {b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a} vs {b}"
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} vs {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def abort_a_stream(base: str, name: str) -> None:
    """A long stream whose client goes away after a few chunks."""
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        json={
            "model": name,
            "messages": [{"role": "user", "content": QUESTIONS[0]}],
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=120,
    ) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)


def check_split(
    model: Path, name: str, extra: list[str], entry: tuple[str, ...] = ("-m", "omlx_logprobs.cli")
) -> dict[str, Any]:
    with server_process(["--model", str(model), *ARGS]) as one:
        want = workload(one.base, name)
    with group_server(model, ARGS + extra, entry=entry) as group:
        abort_a_stream(group.base, name)
        wait_idle(group.base, 60)
        got = workload(group.base, name)
        health = group.health().json()
    log = group.log()  # stopped: rank 0 stopped rank 1
    assert_close(want, got, "workload")
    # Every sequence rank 0 released, rank 1 released too (the abort and the prompt-only
    # request among them).
    assert "rank 1 on " in log and "holding 0 sequences" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return health


def test_tensor_parallel_equals_one_process(tiny_dir: Path) -> None:
    health = check_split(tiny_dir, tiny_dir.name, [])
    group = health["engine"]["distributed"]
    assert health["status"] == "ok" and group["world_size"] == 2 and group["mode"] == "tensor"
    assert [r["rank"] for r in group["ranks"]] == [0, 1]
    assert all(r["state"] == "ok" and "tensor parallel" in r["holds"] for r in group["ranks"])
    assert health["engine"]["aborted_running"] + health["engine"]["aborted_waiting"] == 1


@pytest.mark.slow
def test_pipeline_parallel_equals_one_process(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    model = build_family("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), tokenizer_dir)
    health = check_split(model, model.name, [])
    group = health["engine"]["distributed"]
    assert group["mode"] == "pipeline"
    assert [r["holds"].split(" (")[0] for r in group["ranks"]] == [
        "layers 1-1 of 2",
        "layers 0-0 of 2",
    ]


@pytest.fixture(scope="module")
def odd_heads_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A llama of 3 query heads and 1 KV head: no tensor split over two ranks."""
    out = tmp_path_factory.mktemp("odd_heads")
    return build_family("llama", out, tokenizer_dir, overrides=ODD_HEADS)


def test_heads_that_do_not_divide_split_the_layers_and_equal_one_process(
    odd_heads_dir: Path,
) -> None:
    """SmolLM2's case (9 heads over 2 ranks) on a tiny llama: the layers are split instead, by
    the runner's own ranges (llama has no mlx-lm pipeline), and serve as one process does."""
    health = check_split(odd_heads_dir, odd_heads_dir.name, [])
    group = health["engine"]["distributed"]
    assert group["mode"] == "pipeline"
    assert [r["holds"] for r in group["ranks"]] == [
        "layers 1-1 of 2 (pipeline parallel)",
        "layers 0-0 of 2 (pipeline parallel)",
    ]


def test_a_forced_tensor_split_of_heads_that_do_not_divide_is_refused(
    odd_heads_dir: Path,
) -> None:
    """Both ranks exit at start-up saying why; none with a traceback, none hangs."""
    out = run_to_exit(odd_heads_dir, [*ARGS, "--tensor-parallel"])
    why = (
        "the model cannot be split as asked: tensor parallel over 2 ranks needs"
        " num_attention_heads (3) and num_key_value_heads (1) divisible by 2"
    )
    assert f"ERROR omlx_logprobs[engine]: {why}" in out, out[-3000:]  # rank 0's engine
    assert f"ERROR omlx_logprobs[rank 1]: {why}" in out, out[-3000:]
    assert "Traceback" not in out and "Uvicorn running" not in out, out[-3000:]


@pytest.mark.slow
def test_the_gpu_path_split_equals_one_process(tiny_dir: Path) -> None:
    """The runner's GPU path on the CPU backend (extraction on the device, each step processed on
    a second thread beside the next launch, which reads the sampled ids on the device): rank 0
    reads a step while it queues the next one's collectives."""
    entry = (str(Path(__file__).parents[1] / "helpers" / "gpu_path_serve.py"),)
    health = check_split(tiny_dir, tiny_dir.name, ["--engine", "thread"], entry)
    assert health["engine"]["distributed"]["state"] == "ok"


def test_a_split_model_sleeps_at_level_1_and_refuses_level_2(tiny_dir: Path) -> None:
    name = tiny_dir.name
    with group_server(tiny_dir, ARGS) as group:
        client = _client(group.base)

        def greedy() -> list[Any]:
            r = client.completions.create(
                model=name, prompt=QUESTIONS[1], max_tokens=4, temperature=0, logprobs=1
            )
            return _completion(r)

        before = greedy()
        r = httpx.post(group.base + "/sleep", params={"level": 2}, timeout=30)
        assert "split over processes" in assert_openai_error(r, 400, "level")["message"]
        assert httpx.get(group.base + "/is_sleeping", timeout=5).json() == {"is_sleeping": False}
        assert greedy() == before  # nothing aborted, nothing dropped
        assert httpx.post(group.base + "/sleep", params={"level": 1}, timeout=30).status_code == 200
        assert httpx.get(group.base + "/is_sleeping", timeout=5).json() == {"is_sleeping": True}
        assert httpx.post(group.base + "/wake_up", timeout=30).status_code == 200
        assert httpx.get(group.base + "/is_sleeping", timeout=5).json() == {"is_sleeping": False}
        assert greedy() == before


def test_a_rank_killed_mid_stream_fails_its_requests(tiny_dir: Path) -> None:
    """Started by hand (mlx.launch would stop rank 0 too once rank 1 died): rank 0 stays up."""
    name = tiny_dir.name
    with group_server(tiny_dir, ARGS, launcher=False) as group:
        client = _client(group.base)
        stream = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=2000,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        seen = 0
        with pytest.raises(openai.APIError) as err:
            for _chunk in stream:
                seen += 1
                if seen == 3:
                    group.ranks[1].send_signal(signal.SIGKILL)
        assert "distributed group" in str(err.value), err.value
        deadline = time.time() + 30
        while (r := group.health()).status_code != 503:
            assert time.time() < deadline, r.text
            time.sleep(0.2)
        body = r.json()
        assert body["engine"]["distributed"]["state"] == "lost"
        assert [x["state"] for x in body["engine"]["distributed"]["ranks"]] == ["ok", "lost"]
        t0 = time.time()
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        assert "distributed group" in str(err.value) and time.time() - t0 < 30


@pytest.mark.slow
def test_a_stopped_rank_is_lost_within_seconds(tiny_dir: Path) -> None:
    """A rank that neither dies nor answers (SIGSTOP: as a network split looks from rank 0):
    its liveness link falls silent, and the stream fails in seconds, not at the group timeout."""
    name = tiny_dir.name
    with group_server(tiny_dir, ARGS, launcher=False) as group:
        client = _client(group.base)
        stream = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            max_tokens=2000,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        seen, stopped = 0, 0.0
        try:
            with pytest.raises(openai.APIError) as err:
                for _chunk in stream:
                    seen += 1
                    if seen == 3:
                        group.ranks[1].send_signal(signal.SIGSTOP)
                        stopped = time.time()
            assert "sent nothing" in str(err.value), err.value
            assert time.time() - stopped < 30
            assert group.health().status_code == 503
        finally:
            group.ranks[1].send_signal(signal.SIGCONT)
