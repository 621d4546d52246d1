"""Tinker's API through the real server (uvicorn on loopback, the engine in its own process) and
the `tinker` SDK itself, pointed at it by its base URL: a ServiceClient makes a LoRA
TrainingClient on the served tiny model; forward, forward_backward and optim_step move its
loss; save_weights_for_sampler serves the trained weights at once, and a SamplingClient's
sampled and prompt logprobs equal what `forward` computes for the same tokens; futures are
polled as the SDK polls them. Bad input (an unknown loss, a wrong shape, a model not served)
raises the SDK's errors, and the server keeps serving."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # it needs Python 3.11 (pyproject.toml)
from tinker import types  # noqa: E402

from tests.helpers.server import ServerProcess, server_process  # noqa: E402

PROMPT = [5, 17, 300, 42, 9000, 77, 1200, 8]
TEXT = [9, 31, 4000, 12, 700, 21, 3, 5, 88, 640, 2000, 14]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinker")


@pytest.fixture(scope="module")
def server(tiny_dir: Path, checkpoints: Path) -> Iterator[ServerProcess]:
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info",
            "--tinker-dir", str(checkpoints)]  # fmt: skip
    with server_process(args) as s:
        yield s


@contextlib.contextmanager
def open_service(base: str, **kw: Any) -> Iterator[tinker.ServiceClient]:
    """A ServiceClient closed on the way out, pass or fail, while its server lives: an open one
    heartbeats on from a thread of this process after the server is gone, and its log records
    read as a leak to test_memory later in the run. Closing an expired session's client may
    fail on the server's side; the client's own loops stop all the same."""
    client = tinker.ServiceClient(base_url=base, api_key="tml-local", **kw)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def service(server: ServerProcess) -> Iterator[tinker.ServiceClient]:
    with open_service(server.base) as client:
        yield client


def ce_datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
        },
    )


def is_datum(prompt: list[int], sampled: list[int], logprobs: list[float]) -> types.Datum:
    """An importance-sampling datum of a sampled continuation: the sampler's logprobs and an
    advantage of 1 on its tokens, 0 on the prompt's."""
    tokens, k, n = prompt + sampled, len(prompt) - 1, len(prompt) + len(sampled) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
            "logprobs": types.TensorData(data=[0.0] * k + logprobs, dtype="float32", shape=[n]),
            "advantages": types.TensorData(
                data=[0.0] * k + [1.0] * len(sampled), dtype="float32", shape=[n]
            ),
        },
    )


def forward_logprobs(tc: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    out = tc.forward([ce_datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, np.float32)


def test_train_then_sample(service: tinker.ServiceClient, server: ServerProcess) -> None:
    caps = service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    info = tc.get_info()
    assert info.model_data.model_name == "tiny" and info.lora_rank == 4
    before = forward_logprobs(tc, TEXT)
    fb = tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
    got = np.asarray(fb.loss_fn_outputs[0]["logprobs"].data, np.float32)
    np.testing.assert_array_equal(got, before)  # lora_b starts at zero: the base model's
    assert fb.metrics["loss:sum"] == pytest.approx(-before.sum(), rel=1e-5)
    step = tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    assert step.metrics is not None and step.metrics["grad_norm"] > 0
    after = forward_logprobs(tc, TEXT)
    assert after.sum() > before.sum() + 0.5  # one step on the text made it likelier

    # the trained weights, served at once: sampled and prompt logprobs equal forward's
    sc = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    res = sc.sample(types.ModelInput.from_ints(PROMPT), 2, params,
                    include_prompt_logprobs=True).result()  # fmt: skip
    assert len(res.sequences) == 2
    prompt_lp = forward_logprobs(tc, PROMPT)
    assert res.prompt_logprobs is not None and res.prompt_logprobs[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], prompt_lp, atol=2e-5)
    for seq in res.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        full = forward_logprobs(tc, PROMPT + seq.tokens)
        np.testing.assert_allclose(seq.logprobs, full[len(PROMPT) - 1 :], atol=2e-5)

    # a named save, sampled through its path; the base model's sampler differs
    path = tc.save_weights_for_sampler("first").result().path
    assert path.startswith("tinker://")
    named = service.create_sampling_client(model_path=path).result()
    lps = named.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()
    np.testing.assert_allclose(lps[1:], after, atol=2e-5)
    base = service.create_sampling_client(base_model="tiny").result()
    base_lps = base.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()
    np.testing.assert_allclose(base_lps[1:], before, atol=2e-5)

    # a later step does not change what an earlier snapshot samples
    tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    again = named.compute_logprobs(types.ModelInput.from_ints(TEXT)).result()
    assert again == lps


def test_importance_sampling_on_policy_ratio(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model="tiny", rank=2, seed=5).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=2, stop=[])
    seq = sc.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences[0]
    datum = is_datum(PROMPT, seq.tokens, seq.logprobs or [])
    out = tc.forward_backward([datum], "importance_sampling").result()
    # the sampler's logprobs and the trainer's differ by the float noise of two paths at most
    assert out.metrics["ratio_deviation:max"] < 1e-4
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics


def test_forward_backward_custom(service: tinker.ServiceClient) -> None:
    """`forward_backward_custom` as the SDK computes it: a forward, the loss and its gradient in
    torch on the client, then a cross-entropy step weighted by that gradient. A custom loss that
    is cross-entropy takes the built-in loss's step."""
    torch = pytest.importorskip("torch")
    builtin, custom = (
        service.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
        for _ in range(2)
    )
    data = [ce_datum(TEXT), ce_datum(PROMPT)]

    def loss(data: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        total = sum(-(lp * torch.tensor(d.loss_fn_inputs["weights"].data)).sum()
                    for d, lp in zip(data, logprobs, strict=True))  # fmt: skip
        return total, {"custom": 1.0}

    out = custom.forward_backward_custom(data, loss).result()
    ref = builtin.forward_backward(data, "cross_entropy").result()
    assert out.metrics["custom"] == 1.0
    assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
    for client in (builtin, custom):
        client.optim_step(types.AdamParams(learning_rate=0.02)).result()
    np.testing.assert_allclose(
        forward_logprobs(custom, TEXT), forward_logprobs(builtin, TEXT), atol=1e-6
    )


def test_checkpoints(service: tinker.ServiceClient, checkpoints: Path) -> None:
    """save_state writes mlx-lm's adapter format under --tinker-dir; a training client made from
    it with the optimizer state takes the next step as the original does; load_state brings the
    saved weights back."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
    adam = types.AdamParams(learning_rate=0.02)
    tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(adam).result()
    saved = forward_logprobs(tc, TEXT)
    path = tc.save_state("first").result().path
    assert path == f"tinker://{tc.model_id}/weights/first"
    folder = checkpoints / tc.model_id.replace(":", "_") / "weights" / "first"
    names = {"adapter_config.json", "adapters.safetensors", "optimizer.safetensors"}
    assert {p.name for p in folder.iterdir()} == names
    copy = service.create_training_client_from_state_with_optimizer(path).result()
    assert copy.get_info().lora_rank == 4
    np.testing.assert_array_equal(forward_logprobs(copy, TEXT), saved)
    for client in (tc, copy):
        client.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
        client.optim_step(adam).result()
    moved = forward_logprobs(tc, TEXT)
    np.testing.assert_array_equal(forward_logprobs(copy, TEXT), moved)
    assert np.abs(moved - saved).max() > 1e-3
    tc.load_state(path).result()
    np.testing.assert_array_equal(forward_logprobs(tc, TEXT), saved)
    with pytest.raises(tinker.BadRequestError, match="exists"):
        tc.save_state("first").result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_training_client_from_state("tinker://nope/weights/x").result()


def test_checkpoint_listings_external_weights_and_copies(
    service: tinker.ServiceClient, server: ServerProcess, checkpoints: Path
) -> None:
    """save_weights_external writes the weights alone (mlx-lm's format) under
    external_weights; the REST client lists the runs and their checkpoints (files and served
    sampler weights), says what one is trained on, hands out an external checkpoint's files,
    copies a checkpoint into a run of its own (which loads as the original) and deletes it."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
    state = tc.save_state("listed").result().path
    external = tc.save_weights_external("exported").result().path
    assert external == f"tinker://{tc.model_id}/external_weights/exported"
    folder = checkpoints / tc.model_id.replace(":", "_") / "external_weights" / "exported"
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapters.safetensors"}
    with pytest.raises(tinker.BadRequestError, match="exists"):
        tc.save_weights_external("exported").result()
    served = tc.save_weights_for_sampler("served").result().path

    rest = tinker.RestClient(base_url=server.base, api_key="tml-local")
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("training", state), ("external", external), ("sampler", served)]  # fmt: skip
    assert listed[0].checkpoint_id == "weights/listed" and (listed[0].size_bytes or 0) > 0
    run = rest.get_training_run(tc.model_id).result()
    assert (run.base_model, run.lora_rank, run.is_lora) == ("tiny", 4, True)
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == served
    runs = rest.list_training_runs(limit=100).result()
    assert tc.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= len(runs.training_runs)
    everyone = {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints}
    assert {state, external, served} <= everyone
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.lora_rank, info.train_mlp) == ("tiny", 4, True)
    assert rest.get_weights_info_by_tinker_path(served).result().lora_rank == 4
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        rest.get_weights_info_by_tinker_path(f"tinker://{tc.model_id}/weights/nope").result()
    urls = rest.get_external_weights_urls(external).result().urls
    assert urls == {p.name: p.resolve().as_uri() for p in folder.iterdir()}

    # a time to live (Tinker's bounds: an hour to ten years): listed with its end; the expiry
    # itself is tests/unit/test_checkpoint_store.py's, on a clock of its own
    started = time.time()
    kept = tc.save_state("for-a-day", ttl_seconds=86400).result().path
    brief = tc.save_weights_for_sampler("brief", ttl_seconds=3600).result().path
    ends = {
        c.tinker_path: c.expires_at for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    }
    assert ends[state] is None and ends[served] is None
    for path, ttl in ((kept, 86400), (brief, 3600)):
        end = ends[path]
        assert end is not None and abs(end.timestamp() - started - ttl) < 60, (path, end)
    for save in (tc.save_state, tc.save_weights_for_sampler, tc.save_weights_external):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds is 60"):
            save("too-short", ttl_seconds=60).result()

    copied = rest.copy_weights(state, "archive").result()
    assert copied != state and copied.endswith("/weights/listed")
    again = service.create_training_client_from_state(copied).result()
    np.testing.assert_array_equal(forward_logprobs(again, TEXT), forward_logprobs(tc, TEXT))
    rest.delete_checkpoint_from_tinker_path(copied).result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        service.create_training_client_from_state(copied).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("session-0:train:99").result()


def test_sessions_metadata_and_a_checkpoints_ttl(server: ServerProcess) -> None:
    """The REST client's sessions (list_sessions, get_session: the session's training runs,
    samplers, metadata and name); user_metadata of a session, a training run and named sampler
    weights answered back where Tinker lists them; set_checkpoint_ttl on a checkpoint file and
    on sampler weights, and off again."""
    rest = tinker.RestClient(base_url=server.base, api_key="tml-local")
    with open_service(server.base, user_metadata={"run": "a"}, display_name="math") as service:
        tc = service.create_lora_training_client(
            base_model="tiny", rank=4, seed=3, user_metadata={"lr": "1e-3"}
        ).result()
        served = tc.save_weights_for_sampler("meta", user_metadata={"step": "0"}).result().path
        sid = tc.model_id.split(":")[0]
        got = rest.get_session(sid).result()
        assert (got.training_run_ids, got.user_metadata, got.display_name) == (
            [tc.model_id], {"run": "a"}, "math")  # fmt: skip
        assert len(got.sampler_ids) == 1
        assert sid in rest.list_sessions(limit=100).result().sessions
        assert rest.get_training_run(tc.model_id).result().user_metadata == {"lr": "1e-3"}

        def listed() -> dict[str, types.Checkpoint]:
            return {
                c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints
            }

        assert listed()[served].user_metadata == {"step": "0"}
        state = tc.save_state("ttl").result().path
        started = time.time()
        for path in (state, served):
            rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
            end = listed()[path].expires_at
            assert end is not None and abs(end.timestamp() - started - 7200) < 60, (path, end)
            rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
            assert listed()[path].expires_at is None
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds is 5"):
            rest.set_checkpoint_ttl_from_tinker_path(state, 5).result()
    assert sid not in rest.list_sessions(limit=100).result().sessions  # closed: finished


def test_serving_goes_on_while_training(
    service: tinker.ServiceClient, server: ServerProcess
) -> None:
    """A forward_backward of many long datums runs in padded forwards of a prefill step's tokens
    (two datums each here): completions sent meanwhile are served between them, none lost, most
    finished before the training step."""
    tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    rng = np.random.default_rng(0)
    data = [ce_datum([int(t) for t in rng.integers(10, 40000, 400)]) for _ in range(16)]
    fb = tc.forward_backward(data, "cross_entropy")
    started = time.monotonic()

    def complete(i: int) -> float:
        r = httpx.post(server.base + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": PROMPT + [i], "max_tokens": 8})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        return time.monotonic() - started

    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(complete, range(16)))
    out = fb.result()
    trained = time.monotonic() - started
    assert len(out.loss_fn_outputs) == 16
    print(f"completions done at {sorted(round(t, 2) for t in done)} s; training at {trained:.2f} s")
    assert sum(t < trained for t in done) >= 8  # served while the step ran, not after it
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_cancel_future_aborts_a_sample(server: ServerProcess) -> None:
    """The SDK's cancel_future (on, by the dynamic config) stops a long sample: its engine
    request is aborted at once, and a poll answers that it was cancelled."""
    api = server.base + "/api/v1"
    r = httpx.post(api + "/client/dynamic_config", json={}, timeout=10)
    assert types.ClientDynamicConfigResponse.model_validate(r.json()).sample_cancel_enabled
    req = types.SampleRequest(
        prompt=types.ModelInput.from_ints(PROMPT), base_model="tiny",
        sampling_params=types.SamplingParams(max_tokens=1900, stop=[]),
    )  # fmt: skip
    r = httpx.post(api + "/asample", json=req.model_dump(mode="json"), timeout=10)
    rid = r.json()["request_id"]
    health = {}
    for _ in range(100):  # until it decodes
        health = httpx.get(server.base + "/health", timeout=10).json()["engine"]
        if health["running"]:
            break
        time.sleep(0.05)
    assert health["running"] == 1, health
    aborted = health["aborted_running"]
    r = httpx.post(api + "/cancel_future", json={"request_id": rid}, timeout=10)
    assert r.status_code == 200, r.text
    r = httpx.post(api + "/retrieve_future", json={"request_id": rid}, timeout=60)
    assert r.json() == {"error": f"the request {rid} was cancelled", "category": "user"}
    for _ in range(100):
        health = httpx.get(server.base + "/health", timeout=10).json()["engine"]
        if not health["running"]:
            break
        time.sleep(0.05)
    assert health["running"] == 0 and health["aborted_running"] == aborted + 1, health
    r = httpx.post(api + "/cancel_future", json={"request_id": "nope"}, timeout=10)
    assert r.status_code == 404


def test_bad_input_raises_the_sdk_errors(
    service: tinker.ServiceClient, server: ServerProcess
) -> None:
    with pytest.raises(tinker.BadRequestError, match="not served"):
        service.create_lora_training_client(base_model="nope", rank=4).result()
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="is not available"):
        tc.forward_backward([ce_datum(TEXT)], "nope").result()  # type: ignore[arg-type]
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    wrong = ce_datum(TEXT)
    wrong.loss_fn_inputs["weights"] = types.TensorData(data=[1.0] * 3, dtype="float32", shape=[3])
    with pytest.raises(tinker.BadRequestError, match="must be"):
        tc.forward_backward([wrong], "cross_entropy").result()
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    # ids past the vocabulary: the engine's trainer refuses them, the future fails
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary") as failed:
        tc.forward_backward([ce_datum([10**7, 1, 2])], "cross_entropy").result()
    assert failed.value.category == types.RequestErrorCategory.User
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="context"):
        tc.forward_backward([ce_datum(list(range(10, 2060)))], "cross_entropy").result()
    sc = service.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=4)
    stable = service.create_sampling_client(base_model="tiny", record_stability_info=True)
    with pytest.raises(tinker.BadRequestError, match="record_stability_info is not served"):
        stable.result().sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="not a token id"):
        sc.sample(types.ModelInput.from_ints([5, 10**7]), 1, params).result()
    with pytest.raises(tinker.BadRequestError, match="maximum context length"):
        sc.sample(types.ModelInput.from_ints(PROMPT), 1,
                  types.SamplingParams(max_tokens=5000)).result()  # fmt: skip
    # the server goes on serving: training, sampling and the OpenAI routes
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    assert tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result().metrics
    r = httpx.post(server.base + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert len(sc.sample(types.ModelInput.from_ints(PROMPT), 2, params).result().sequences) == 2


def test_batch_invariant_forward_equals_sample_bit_for_bit(invariant: ServerProcess) -> None:
    """With `--batch-invariant` (runner/invariance.py), the logprobs `forward` computes for
    sampled tokens are the bits `sample` returned, and an on-policy importance ratio is 1.0.
    The server: the session's batch-invariant one (conftest.py), which test_batch_invariant
    asks too."""
    with open_service(invariant.base) as service:
        tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
        tc.forward_backward([ce_datum(TEXT)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        sc = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=4, stop=[])
        res = sc.sample(types.ModelInput.from_ints(PROMPT), 3, params,
                        include_prompt_logprobs=True).result()  # fmt: skip
        assert res.prompt_logprobs_np is not None
        prompt_lp = forward_logprobs(tc, PROMPT)
        np.testing.assert_array_equal(res.prompt_logprobs_np[1:], prompt_lp)
        for seq in res.sequences:
            full = forward_logprobs(tc, PROMPT + seq.tokens)
            np.testing.assert_array_equal(seq.logprobs_np, full[len(PROMPT) - 1 :])
            datum = is_datum(PROMPT, seq.tokens, seq.logprobs or [])
            out = tc.forward([datum], "importance_sampling").result()
            assert out.metrics["ratio_deviation:max"] == 0.0
        # the same datums in one padded forward (the prompt alone the shorter row): the same bits
        data = [ce_datum(PROMPT + seq.tokens) for seq in res.sequences] + [ce_datum(PROMPT)]
        together = tc.forward(data, "cross_entropy").result().loss_fn_outputs
        for seq, out in zip(res.sequences, together):
            lp = np.asarray(out["logprobs"].data, np.float32)
            np.testing.assert_array_equal(seq.logprobs_np, lp[len(PROMPT) - 1 :])
        lp = np.asarray(together[-1]["logprobs"].data, np.float32)
        np.testing.assert_array_equal(res.prompt_logprobs_np[1:], lp)


def test_a_session_without_heartbeats_expires(tiny_dir: Path) -> None:
    """Unheard of for longer than the server's bound (3 s here; the SDK's first heartbeat comes
    after 10 s), a session ends as a finished one does: its training model and its sampler
    snapshot go, and its heartbeat is the 410 on which the SDK stops heartbeating."""
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    args += ["--tinker-session-timeout", "3"]
    with server_process(args) as s:
        with open_service(s.base) as service:
            tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
            sc = tc.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=2)
            assert sc.sample(types.ModelInput.from_ints(PROMPT), 1, params).result().sequences
            time.sleep(6)  # the bound, and the sweep that runs every second of it
            with pytest.raises(tinker.BadRequestError, match="no training model"):
                tc.forward([ce_datum(TEXT)], "cross_entropy").result()
            with pytest.raises(tinker.BadRequestError, match="no sampler"):
                sc.sample(types.ModelInput.from_ints(PROMPT), 1, params).result()
            sid = tc.model_id.split(":")[0]
            r = httpx.post(s.base + "/api/v1/session_heartbeat", timeout=10,
                           json={"session_id": sid, "type": "session_heartbeat"})  # fmt: skip
            assert r.status_code == 410, r.text
            assert "ended" in s.log()
        # the server serves a new session as before
        with open_service(s.base) as fresh:
            tc = fresh.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
            assert tc.forward([ce_datum(TEXT)], "cross_entropy").result().loss_fn_outputs


def test_max_output_tokens_bounds_a_sample(tiny_dir: Path) -> None:
    """--max-output-tokens bounds Tinker's samples as every route's: the default (16) held at
    it, a larger max_tokens the SDK's BadRequestError; and a chat request that names none."""
    args = ["--model", str(tiny_dir), "--served-model-name", "tiny", "--log-level", "info"]
    with server_process([*args, "--max-output-tokens", "4"]) as s:
        with open_service(s.base) as service:
            sc = service.create_sampling_client(base_model="tiny").result()
            prompt = types.ModelInput.from_ints(PROMPT)
            [seq] = sc.sample(prompt, 1, types.SamplingParams(stop=[])).result().sequences
            assert len(seq.tokens) == 4 and seq.stop_reason == "length"
            with pytest.raises(tinker.BadRequestError, match="at most 4"):
                sc.sample(prompt, 1, types.SamplingParams(max_tokens=5)).result()
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Hi"}],
                "ignore_eos": True,
            }
            r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            assert r.json()["choices"][0]["finish_reason"] == "length"
