"""The `serve` command's flags: every flag's default, range and help in one place (cli.py runs
the command; serve_config.py makes the `ServerConfig` from what they parse)."""

from __future__ import annotations

import argparse
import os

from omlx_logprobs.config import (
    LOGPROBS_MODES,
    BatchConfig,
    EngineConfig,
    Limits,
    PoolConfig,
    ServerConfig,
    TinkerConfig,
)
from omlx_logprobs.parsing.thinking import ReasoningParser
from omlx_logprobs.parsing.tools import ToolCallFormat

API_KEY_ENV = "OMLX_LOGPROBS_API_KEY"  # a key in the environment stays out of `ps` listings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omlx-logprobs")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_model(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--max-logprobs",
        "--max-top-logprobs",
        dest="max_logprobs",
        type=int,
        default=EngineConfig.max_top_logprobs,
        help="the most top logprobs (and prompt logprobs) a request may ask for; -1: the whole"
        " vocabulary (vLLM's flag; default: %(default)s)",
    )
    _add_batching(s)
    _add_batches(s)
    _add_tinker(s)
    _add_speculation(s)
    _add_pool(s)
    _add_output(s)
    s.add_argument(
        "--engine",
        choices=["process", "thread"],
        default="process",
        help="run the engine in a process of its own (default; the event loop and the step loop"
        " then hold separate GILs) or in a thread of the server's process",
    )
    s.add_argument("--log-level", default="info")
    s.add_argument(
        "--ignore-unknown-fields",
        action="store_true",
        help="accept request fields this server does not know (clients that send vendor"
        " extras): a warning in the log and an X-Ignored-Fields response header name them;"
        " without it such a request is a 400 naming the field, as OpenAI answers",
    )
    _add_limits(s)
    _add_access(s)
    _add_distributed(s)
    return p


def _add_model(s: argparse.ArgumentParser) -> None:
    """What is served: the models, their names, LoRA adapters, where they come from, the dtype."""
    s.add_argument(
        "--model",
        action="append",
        default=None,
        help="mlx-lm model directory, .gguf file, Hugging Face name (org/name: from the local"
        " Hugging Face cache, else downloaded) or scripted model description (.json); default:"
        " the embedded SmolLM2-135M-Instruct. Give it again to serve several models (a request"
        " picks one by `model`); the first is the default of routes that name none",
    )
    s.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name the model is served under (default: its directory's or file's name);"
        " given once per --model, in the same order",
    )
    s.add_argument(
        "--task",
        action="append",
        default=None,
        choices=["auto", "generate", "embed"],
        help="what the model serves besides generation: embed, embeddings too (/v1/embeddings,"
        " /api/embed: last-token pooling, normalized); auto (default), embed where its"
        " sentence-transformers files pool the last token (Qwen3-Embedding); generate, never."
        " Given once per --model in the same order, or once for every model",
    )
    s.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve a LoRA adapter (an mlx-lm adapter directory, as mlx_lm.lora writes it) on the"
        " first --model under NAME: a request names it by `model`; requests on different adapters"
        " and on the model batch together. Repeatable; more load at run time with"
        " POST /v1/load_lora_adapter",
    )
    s.add_argument(
        "--offline",
        action="store_true",
        help="never download: a Hugging Face name must be in the local cache (as HF_HUB_OFFLINE=1)",
    )
    s.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the activations' dtype: auto is float32 on the CPU (a quantized model dequantized"
        " to float32 once at load when it fits) and the stored dtype on a GPU; float32 on a GPU"
        " is the exact mode; the log-softmax is float32 always",
    )


def _add_output(s: argparse.ArgumentParser) -> None:
    """How a model's output is read: reasoning, tool calls, what logprobs describe."""
    s.add_argument(
        "--reasoning-parser",
        choices=[m.value for m in ReasoningParser],
        default=ReasoningParser.AUTO.value,
        help="split <think> reasoning from the answer: auto (when the model has think markers),"
        " think (always) or none",
    )
    s.add_argument(
        "--reasoning-budgets",
        default=None,
        metavar="EFFORT=TOKENS,...",
        help="a thinking budget per reasoning_effort, e.g. low=1024,medium=4096,high=16384:"
        " a request naming that effort (chat's reasoning_effort, Responses' reasoning.effort,"
        " Ollama's think level) and no thinking_token_budget gets it; at the budget the"
        " model's closing tag is forced",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=[m.value for m in ToolCallFormat],
        default=ToolCallFormat.AUTO.value,
        help="the format of the model's tool calls: auto (from the chat template), hermes"
        " (<tool_call> JSON, Qwen), qwen3_coder (<tool_call> XML), llama3_json, mistral, harmony"
        " (gpt-oss), or none",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=list(LOGPROBS_MODES),
        default="raw_logprobs",
        help="what logprobs describe when a request names no logprobs_mode",
    )
    s.add_argument(
        "--flat-logprobs",
        action="store_true",
        help="chat logprobs: every generated token's entry in logprobs.content, in order,"
        " reasoning and tool-call tokens included (as vLLM writes them), for requests that do"
        " not say (a request's flat_logprobs decides; return_token_ids implies it)",
    )
    s.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="vLLM's flag: on a mixture of experts whose routing is recorded (qwen3_moe,"
        " qwen2_moe, mixtral), every choice returns its routed_experts, as if each request"
        " asked with return_routed_experts (docs/specs/rl.md)",
    )
    s.add_argument(
        "--faithful-answers",
        type=int,
        default=ServerConfig.faithful_answers,
        metavar="N",
        help="how many answers' sampled token ids are remembered, so that a conversation sent"
        " back keeps them instead of re-tokenizing its text (token-faithful conversations,"
        " docs/specs/rl.md); 0: none, earlier turns are tokenized from their text"
        " (default: %(default)s)",
    )
    s.add_argument(
        "--rerank-template",
        default=None,
        metavar="FILE",
        help="the text /rerank and /score write each query and document into, with {query},"
        " {document} (after the query) and {instruction} places; the score is p(yes) from the"
        " `yes` and `no` tokens' logits after it. Default: Qwen3-Reranker's prompt"
        " (docs/specs/rerank.md)",
    )


def _add_distributed(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group(
        "several processes (under mlx.launch; docs/distributed.md): rank 0 serves, every rank"
        " holds a share of the model"
    )
    way = g.add_mutually_exclusive_group()
    way.add_argument(
        "--tensor-parallel",
        dest="parallel",
        action="store_const",
        const="tensor",
        default="auto",
        help="split every layer's heads and MLP over the processes (the default where mlx-lm's"
        " family has it and the process count divides what it splits; refused where it does"
        " not)",
    )
    way.add_argument(
        "--pipeline-parallel",
        dest="parallel",
        action="store_const",
        const="pipeline",
        help="give each process consecutive layers (the default for families without tensor"
        " parallelism, and where the process count does not divide the heads)",
    )
    g.add_argument(
        "--group-timeout-s",
        type=float,
        default=EngineConfig.group_timeout_s,
        help="how long rank 0 waits on the other processes in one step before it declares the"
        " group lost (a stuck process or a network split; a dead one is seen at once)"
        " (default: %(default)s)",
    )


def _add_batching(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("batching and memory")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens computed per prefill step, in all (a kept prefix is free; default:"
        " 2048 on a GPU, 1024 on the CPU)",
    )
    g.add_argument(
        "--prefill-delay-ms",
        type=float,
        default=None,
        help="while a batch decodes, how long a new prompt may wait to prefill together with"
        " others (default: 20 on a GPU, 0 on the CPU)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--mlx-cache-limit-mib",
        type=int,
        default=None,
        help="freed MLX buffers kept for reuse, in MiB (default: 4096 on a GPU, MLX's own on"
        " the CPU); the cache is also emptied once the server has been idle for about 0.5 s",
    )
    g.add_argument(
        "--batch-invariant",
        action="store_true",
        help="logprobs that depend only on the tokens, bit for bit: the same whatever else is"
        " in the batch, whether a prefix came from the cache, the prefill chunk, speculation;"
        " and equal to omlx_logprobs.runner.scorer's (an RL trainer's own forward): every"
        " product in BLAS calls of one shape. Checked at start-up (docs/specs/logprobs.md,"
        " Batch-invariant mode)",
    )
    g.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=EngineConfig.prefix_cache_mib,
        help="memory for the keys and values of finished sequences (a conversation's turns,"
        " prompt and answer) and of prompt starts that requests share, so that a prompt"
        " starting with one prefills only what follows; 0 turns prefix caching off (default:"
        " a quarter of the memory left after the weights, at most 16384)",
    )
    g.add_argument(
        "--kv-cache-dir",
        default=None,
        help="a folder (on an SSD) where the prefix cache keeps what its memory evicts, and at"
        " shutdown what it holds: found again by later requests, and by the server after a"
        " restart; one subfolder per model, keyed by its weights",
    )
    g.add_argument(
        "--kv-cache-disk-mib",
        type=int,
        default=EngineConfig.kv_cache_disk_mib,
        help="the size limit of --kv-cache-dir in MiB; the least recently used go first"
        " (default: %(default)s)",
    )


def _add_batches(s: argparse.ArgumentParser) -> None:
    d = BatchConfig()
    g = s.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument(
        "--batch-dir",
        default=default_batch_dir(),
        help="where uploaded files, batches and their results are kept; a restarted server"
        " goes on with the unfinished batches found there (default: %(default)s)",
    )
    g.add_argument(
        "--batch-concurrency",
        type=int,
        default=d.concurrency,
        help="batch lines in flight at once, of all batches together, each at a lower"
        " priority than every interactive request (default: %(default)s)",
    )
    g.add_argument(
        "--max-file-bytes",
        type=int,
        default=d.max_file_bytes,
        help="the largest file /v1/files takes; a larger one is a 400 (default: %(default)s)",
    )


def _add_tinker(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("Tinker's training API (/api/v1/)")
    g.add_argument(
        "--tinker-dir",
        default=default_tinker_dir(),
        help="where save_weights writes checkpoints, in mlx-lm's adapter format (`--lora` and"
        " mlx-lm load them); load_weights reads them back (default: %(default)s)",
    )
    g.add_argument(
        "--tinker-session-timeout",
        type=float,
        default=TinkerConfig.session_timeout_s,
        metavar="SECONDS",
        help="a session unheard of this long (no heartbeat, no call; the SDK heartbeats every"
        " 10 s) ends, its training runs and sampler snapshots dropped (default: %(default)s)",
    )


def default_batch_dir() -> str:
    """The user's cache folder (XDG_CACHE_HOME, else ~/.cache), `omlx_logprobs/batches`."""
    return _cache_dir("batches")


def default_tinker_dir() -> str:
    """The user's cache folder, `omlx_logprobs/tinker`."""
    return _cache_dir("tinker")


def _cache_dir(name: str) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "omlx_logprobs", name)


def _add_speculation(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculate",
        choices=("off", "prediction", "lookup", "draft"),
        default=None,
        help="speculative decoding, whose tokens and logprobs are exactly the model's own"
        " (docs/specs/speculation.md): 'prediction' drafts from a chat request's `prediction`"
        " (OpenAI's Predicted Outputs), 'lookup' also from n-grams of each request's own"
        " prompt and output, 'draft' from the prediction, else --draft-model's argmax; 'off'"
        " never (default: draft with --draft-model, else prediction)",
    )
    g.add_argument(
        "--draft-model",
        default=None,
        help="a small model sharing the served model's tokenizer (a local mlx-lm directory,"
        " or whatever --model takes) that drafts tokens for the served model to verify;"
        " refused at start-up if its vocabulary differs",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=int,
        default=EngineConfig.num_draft_tokens,
        help="draft tokens verified per speculative step (default: %(default)s)",
    )
    g.add_argument(
        "--speculate-max-batch",
        type=int,
        default=EngineConfig.speculate_max_batch,
        help="the largest decoding batch that speculates: beyond it a step is no longer bound"
        " by the host, and verifying drafts costs more than it saves (default: %(default)s)",
    )


def _add_pool(s: argparse.ArgumentParser) -> None:
    d = PoolConfig()
    g = s.add_argument_group("several models (--model given more than once)")
    g.add_argument(
        "--max-loaded-models",
        type=int,
        default=d.max_loaded,
        help="models loaded at once; a request for another unloads the least recently used idle"
        " one first (default: no limit)",
    )
    g.add_argument(
        "--max-model-memory-mib",
        type=int,
        default=d.memory_mib,
        help="memory the loaded models' weights may take together, in MiB, estimated from the"
        " weight files at the dtype they are cast to (--dtype; float32 on the CPU) plus 10%%;"
        " models are unloaded as with --max-loaded-models (default: no budget)",
    )
    g.add_argument(
        "--model-load-timeout-s",
        type=float,
        default=d.load_timeout_s,
        help="how long a request for an unloaded model waits for a busy one to go idle so that"
        " it can be unloaded, before a 503 with Retry-After (default: %(default)s)",
    )


def _add_access(s: argparse.ArgumentParser) -> None:
    sec = s.add_argument_group("access")
    sec.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on every route but /health (or ${API_KEY_ENV})",
    )
    sec.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated CORS origins (default: none, no CORS headers)",
    )
    sec.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no GET /metrics and observe no request for it (Prometheus metrics are on"
        " by default)",
    )
    sec.add_argument(
        "--shutdown-grace",
        type=float,
        default=ServerConfig.shutdown_grace_s,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM",
    )


def _add_limits(s: argparse.ArgumentParser) -> None:
    d = Limits()
    g = s.add_argument_group("limits (each breach is a 4xx naming the parameter)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued,
        help="requests in flight beyond --max-num-seqs before a 429",
    )
    g.add_argument(
        "--max-output-tokens",
        type=int,
        default=d.max_output_tokens,
        help="output tokens of one request: a larger max_tokens sent is a 400; a request that"
        " sends none gets the smaller of this and the context left (default: the context)",
    )
    g.add_argument("--max-n", type=int, default=d.max_n)
    g.add_argument("--max-stop", type=int, default=d.max_stop)
    g.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars)
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids)
    g.add_argument("--max-logprob-token-ids", type=int, default=d.max_logprob_token_ids)
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help="width x height of one image (checked before it is decoded)",
    )
    g.add_argument("--max-images", type=int, default=d.max_images, help="images per request")
    g.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="images may be read from local files (file:// URLs) only under this folder",
    )
    g.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs (bounded by --max-body-bytes and"
        " --image-fetch-timeout); else a 400",
    )
    g.add_argument(
        "--image-fetch-timeout",
        type=float,
        default=d.image_fetch_s,
        help="seconds an http(s) image URL's whole fetch may take (--allow-image-urls)",
    )
