"""Runs inside the verifiers venv (`make verifiers-venv`: pinned verifiers, its own openai<3),
never imported by the suite: verifiers' own environments and clients, unmodified, against the
server at argv[1] (serving argv[2]); prints what they collected for training as JSON.

- a single-turn environment and a multi-turn tool environment through the classic token client
  (`openai_chat_completions_token`: its first turn posts /v1/chat/completions, later turns
  /tokenize and /v1/chat/completions/tokens);
- the same tool environment through the renderer client (`renderer`), which renders with the
  model's tokenizer (argv[3], a local directory: nothing is downloaded) and posts
  /inference/v1/generate;
- (`salted`) that environment with `cache_salt` and `priority` in the sampling args'
  `extra_body`, as a pipeline-RL trainer sets them: through the renderer client under salts
  a, b, then a again, and through the token client under salt c; each request's salt and
  priority as sent and the cached prompt tokens the server answered are recorded.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import verifiers as vf
from datasets import Dataset
from verifiers.clients import resolve_client

BASE, MODEL, TOKENIZER = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.setdefault("OMLX_TEST_KEY", "unused")


def get_weather(city: str) -> str:
    """The weather now in a city.

    Args:
        city: The city.
    """
    return "sunny"


def reward(completion: Any, **kwargs: Any) -> float:
    return 1.0


def dataset() -> Dataset:
    return Dataset.from_list([{"question": "Case: weather", "answer": "sunny"}])


def client(kind: str) -> Any:
    extra: dict[str, Any] = {}
    if kind == "renderer":  # the model's own template, its calls read as Qwen's (Hermes)
        extra = {"renderer_model_name": TOKENIZER,
                 "renderer_config": {"name": "default", "tool_parser": "qwen3"}}  # fmt: skip
    cfg = vf.ClientConfig(client_type=kind, api_base_url=BASE + "/v1",
                          api_key_var="OMLX_TEST_KEY", max_retries=0, **extra)  # fmt: skip
    resolved = resolve_client(cfg)
    # watch, never change: the paths the client posts to (the httpx client under its openai one)
    http = getattr(getattr(resolved, "client", None), "_client", None)
    if http is not None:
        http.event_hooks["request"].append(record)
        http.event_hooks["response"].append(answered)
    return resolved


PATHS: list[str] = []
CALLS: list[dict[str, Any]] = []  # per request with a JSON body: its salt, priority, cached


async def record(request: Any) -> None:
    PATHS.append(request.url.path)
    if request.method == "POST" and request.content:
        body = json.loads(request.content)
        CALLS.append({"path": request.url.path, "cache_salt": body.get("cache_salt"),
                      "priority": body.get("priority")})  # fmt: skip


async def answered(response: Any) -> None:
    """The cached prompt tokens the server reports (read here: the body is kept for the
    client, which reads it again)."""
    if response.request.method != "POST" or not CALLS:
        return
    await response.aread()
    usage = response.json().get("usage") or {}
    CALLS[-1]["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def rollout(env: Any, kind: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    inputs = env.get_eval_inputs(1, 1) if hasattr(env, "get_eval_inputs") else None
    if inputs is None:
        inputs = env._get_eval_inputs(1, 1)
    PATHS.clear()
    CALLS.clear()
    args: dict[str, Any] = {"temperature": 0.0, "max_tokens": 64}
    if extra is not None:
        args["extra_body"] = extra
    state = await env.rollout(inputs[0], client(kind), MODEL, args)
    steps = []
    for step in state["trajectory"]:
        t = step["tokens"]
        steps.append({
            "prompt_ids": list(t["prompt_ids"]), "completion_ids": list(t["completion_ids"]),
            "completion_logprobs": list(t["completion_logprobs"]),
        })  # fmt: skip
    error = repr(state.get("error")) if state.get("error") else None
    return {"error": error, "steps": steps, "paths": list(PATHS), "calls": list(CALLS)}


async def main() -> None:
    single = vf.SingleTurnEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[reward]))
    tools = vf.ToolEnv(dataset=dataset(), tools=[get_weather], max_turns=3,
                       rubric=vf.Rubric(funcs=[reward]))  # fmt: skip
    mode = sys.argv[4] if len(sys.argv) > 4 else None
    if mode == "salted":
        runs = [("renderer", "a"), ("renderer", "b"), ("renderer", "a"),
                ("openai_chat_completions_token", "c")]  # fmt: skip
        salted = [await rollout(tools, kind, {"cache_salt": s, "priority": -2}) for kind, s in runs]
        print(json.dumps({"salted": salted}))
        return
    out = {
        "single_turn": await rollout(single, "openai_chat_completions_token"),
        "tool_turns": await rollout(tools, "openai_chat_completions_token"),
    }
    if mode == "renderer":
        out["renderer"] = await rollout(tools, "renderer")
    print(json.dumps(out))


asyncio.run(main())
