"""`omlx-logprobs serve`: load a model and serve it over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# transformers' advice that PyTorch is missing: the server uses its tokenizers only, never torch.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import omlx_logprobs  # noqa: E402
from omlx_logprobs import heap  # noqa: E402
from omlx_logprobs.config import (  # noqa: E402
    ServerConfig,
)
from omlx_logprobs.options import build_parser
from omlx_logprobs.parsing.thinking import (  # noqa: E402
    ReasoningParser,
    parser_enabled,
    reasoning_tags,
)
from omlx_logprobs.parsing.tools import ToolCallFormat, resolve_format  # noqa: E402
from omlx_logprobs.serve_config import config_from_args  # noqa: E402

if TYPE_CHECKING:
    from omlx_logprobs.api.core.served import Served
    from omlx_logprobs.api.core.slot import ModelSlot
    from omlx_logprobs.control import WeightVersion
    from omlx_logprobs.models.loader import LoadedModel
    from omlx_logprobs.transport.client import EngineClient

log = logging.getLogger("omlx_logprobs")
# MLX settings the server applies unless the environment holds them (measured: docs/benchmarks.md,
# "Decisions that shape the code"); MLX_BACKENDS says which backends read each one.
MLX_ENVIRONMENT = {
    # Full float32 matmuls, not TF32 (CUDA, M5): with TF32 a float32 model's logprobs moved
    # ~1e-3 with the shape of the batch they ran in.
    "MLX_ENABLE_TF32": "0",
    # A serving batch changes shape every step: CUDA graphs were built, used once and evicted;
    # direct launches ran top-20 steps ~12% faster. If turned back on: 64 kept.
    "MLX_USE_CUDA_GRAPHS": "0",
    "MLX_CUDA_GRAPH_CACHE_SIZE": "64",
    # cuDNN's attention for long one-row prefills, at a few padded shapes whose graphs are built
    # at start-up (runner/query_blocks.py; a graph per new shape had cost 60-250 ms). H200, 8B
    # 4-bit, conversation to 21k tokens: turns 0.47-0.66 s against 0.50-1.21 off, a cold 21k
    # prompt 2.95 s against 4.76; one row's decode the same (docs/benchmarks.md). MLX's 256
    # graphs kept: decode keeps a graph per cache length, and the start-up ones must stay.
    "MLX_CUDA_USE_CUDNN_SDPA": "1",
    "MLX_CUDA_SDPA_CACHE_SIZE": "256",
    # With bounded caches MLX would raise after 2x capacity misses in total.
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
}
# Padded tokens in one encoder forward (transport/encoder.py): its activations and every
# layer's attention scores are in memory at once.
ENCODER_BATCH_TOKENS = 8192
MLX_BACKENDS = {"MLX_ENABLE_TF32": ("cuda", "metal")}  # every other one: CUDA only


def mlx_backend() -> str:
    """cuda, metal or cpu: the backend MLX computes on here."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    return "cuda" if mx.cuda.is_available() else "metal"


def mlx_settings(backend: str) -> str:
    """The log's MLX line: the backend and the settings it reads (none on the CPU)."""
    read = [k for k in MLX_ENVIRONMENT if backend in MLX_BACKENDS.get(k, ("cuda",))]
    return ", ".join([f"backend {backend}", *(f"{k}={os.environ.get(k)}" for k in read)])


def serve(cfg: ServerConfig, args: argparse.Namespace) -> list[int]:
    from omlx_logprobs.api.app import create_app
    from omlx_logprobs.api.core.pool import ModelPool
    from omlx_logprobs.api.scoring.template import YesNoTemplate
    from omlx_logprobs.api.server import run_server
    from omlx_logprobs.transport.starting import end_on_signal

    end_on_signal()  # engine processes started before uvicorn's handlers end with the server
    log.info("BLAS: %s", omlx_logprobs.BLAS)
    log.info("heap: %s", omlx_logprobs.HEAP)
    log.info("MLX: %s", mlx_settings(mlx_backend()))
    heap.set_switch_interval()
    from omlx_logprobs.runner.lora import AdapterError, read_adapter

    try:  # the file, before any model loads
        where = args.rerank_template
        text = Path(where).expanduser().read_text(encoding="utf-8") if where else None
        template = YesNoTemplate.of(text, where or "")
    except (OSError, ValueError) as e:
        raise SystemExit(f"omlx-logprobs serve: error: --rerank-template: {e}") from None
    for name, path in cfg.lora:  # the files, before any model loads (their fit: at the load)
        try:
            read_adapter(path)
        except AdapterError as e:
            raise SystemExit(f"omlx-logprobs serve: error: --lora {name}: {e}") from None
    if cfg.engine.draft_model is not None:  # before any weights load: the tokenizers alone
        from omlx_logprobs.models.draft import draft_refusal

        why = draft_refusal(cfg.model, cfg.engine.draft_model)
        if why is not None:
            raise SystemExit(f"omlx-logprobs serve: error: --draft-model: {why}")
    try:
        pool = ModelPool(
            model_slots(cfg),
            partial(load_served, cfg, args),
            cfg.pool,
            cfg.limits,
            cfg.engine,
            load_tokenizer=partial(load_tokenizer, cfg),
            ignore_unknown_fields=args.ignore_unknown_fields,
            traits=partial(traits, args),
        )
    except ValueError as e:  # two models under one name, a model larger than the budget
        raise SystemExit(f"omlx-logprobs serve: error: {e}") from None
    try:
        pool.load_at_start()
    except (AdapterError, RuntimeError) as e:  # an adapter that does not fit the model, ...
        raise SystemExit(f"omlx-logprobs serve: error: {e}") from None
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and cfg.access.api_key is None:
        log.warning(
            "listening on %s without --api-key: anyone who can reach it may use it", cfg.host
        )
    app = create_app(
        pool, cfg.access, template, cfg.batches, metrics=cfg.metrics, tinker=cfg.tinker
    )
    heap.freeze_startup_objects()
    return run_server(app, pool.begin_shutdown, cfg, args.log_level)


def model_slots(cfg: ServerConfig) -> list[ModelSlot]:
    """Every --model resolved (a GGUF converted once) and named, with its memory estimate."""
    import mlx.core as mx

    from omlx_logprobs.api.core.slot import ModelSlot
    from omlx_logprobs.models.embedding import read_embedding
    from omlx_logprobs.models.footprint import weight_mib
    from omlx_logprobs.models.loader import gguf_origin, is_scripted, resolve_model_path
    from omlx_logprobs.models.scripted import ScriptedSpec

    # What the loader casts the weights to (models/dtype.py): auto is float32 on the CPU, with
    # quantized weights dequantized when they fit, and the stored dtype on a GPU.
    cpu, dtype = mx.default_device() == mx.cpu, cfg.engine.dtype
    float_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4 if cpu else None)
    slots = []
    for i, (source, name) in enumerate(cfg.models):
        origin = None  # the GGUF file converted, if one was
        embedding = None  # what it embeds with (models/embedding.py), if it does
        if is_scripted(source):
            path = Path(source).expanduser()
            name = name or ScriptedSpec.read(path).name
        else:
            origin = gguf_origin(source)
            path, default_name = resolve_model_path(source, cfg.offline)
            source, name = str(path), name or default_name
            embedding = read_embedding(path, cfg.task(i))
            if embedding is not None and embedding.encoder:
                _require_mlx_embeddings(path)
        need = weight_mib(path, float_bytes, dequantize=cpu and dtype == "auto")
        slots.append(ModelSlot(name, source, need, origin=origin, embedding=embedding))
    slots[0].adapters.update(cfg.lora)
    return slots


def _require_mlx_embeddings(path: Path) -> None:
    """An encoder runs on mlx-embeddings, which `make install` adds with --no-deps: said at
    start (a ValueError, as a refused directory) rather than at its first load."""
    import importlib.util

    if importlib.util.find_spec("mlx_embeddings") is None:
        raise ValueError(
            f"{path} is an encoder embedding model, served through mlx-embeddings, which is not"
            " installed: pip install --no-deps mlx-embeddings==0.1.0 mlx-vlm==0.7.10"
        )


def load_tokenizer(cfg: ServerConfig, slot: ModelSlot) -> LoadedModel:
    """A model's tokenizer and facts without its weights (/tokenize while it is not loaded)."""
    from omlx_logprobs.models.loader import load_model

    return load_model(slot.source, slot.name, cfg.engine.max_model_len, weights=False)


def load_served(cfg: ServerConfig, args: argparse.Namespace, slot: ModelSlot) -> Served:
    """A model's engine (not yet started) and what the routes need of it."""
    from omlx_logprobs.api.core.served import Served

    if slot.embedding is not None and slot.embedding.encoder:
        model, engine = start_encoder(cfg, slot)
    else:
        model, engine = start_engine(
            cfg,
            args.log_level,
            (slot.source, slot.name),
            slot.weights_path,
            slot.weights,
            tuple(slot.adapters.items()),
        )
    log.info(
        "model %s from %s (vocab %d, context %d)",
        model.name,
        model.path,
        len(model.vocab),
        model.max_model_len,
    )
    tool_format, reasoning = parsers(args, model)
    log.info("reasoning parser: %s", "on" if reasoning else "off")
    log.info("tool-call parser: %s", tool_format.value)
    if (e := slot.embedding) is not None:
        log.info("embeddings: %s pooling%s%s (%s)", e.pooling, ", normalized" if e.normalize
                 else "", ", Matryoshka" if e.matryoshka else "", e.source)  # fmt: skip
    return Served(
        engine,
        model,
        cfg.engine,
        reasoning=reasoning,
        tool_format=tool_format.value,
        reasoning_tags=reasoning_tags(model.tokenizer),
        limits=cfg.limits,
        ignore_unknown_fields=args.ignore_unknown_fields,
        faithful_answers=cfg.faithful_answers,
        embedding=slot.embedding,
    )


def parsers(args: argparse.Namespace, model: LoadedModel) -> tuple[ToolCallFormat, bool]:
    """The tool-call format a model's responses are parsed for, and whether its reasoning is
    (--tool-call-parser and --reasoning-parser, auto resolved from its chat template)."""
    tool_format = resolve_format(ToolCallFormat(args.tool_call_parser), model.tokenizer)
    return tool_format, parser_enabled(ReasoningParser(args.reasoning_parser), model.tokenizer)


def traits(args: argparse.Namespace, model: LoadedModel) -> tuple[bool, bool]:
    """Whether a model takes tools and reasons, as served (/v1/models, before it loads)."""
    tool_format, reasoning = parsers(args, model)
    return tool_format is not ToolCallFormat.NONE, reasoning


def start_engine(
    cfg: ServerConfig,
    log_level: str,
    which: tuple[str | None, str | None] | None = None,
    weights_path: str | None = None,
    weights: WeightVersion | None = None,
    adapters: tuple[tuple[str, str], ...] = (),
) -> tuple[LoadedModel, EngineClient]:
    """The model's tokenizer and facts for the API, and the engine's client: over a child
    process that loads the weights (the server's process then loads none), or over a thread
    of this one. `which`: (source, served name), default the first --model; `weights_path`
    and `weights`: weights loaded in place before, which a reload serves under their
    version; `adapters`: the LoRA adapters (name, path) it serves from the start."""
    from omlx_logprobs.control import INITIAL_WEIGHTS
    from omlx_logprobs.models.loader import is_scripted, load_model, resolve_model_path
    from omlx_logprobs.transport.build import build_engine
    from omlx_logprobs.transport.client import EngineClient, ThreadTransport
    from omlx_logprobs.transport.messages import EngineSpec
    from omlx_logprobs.transport.process import ProcessTransport
    from omlx_logprobs.vocab import build_vocabulary

    # The model is resolved once, here (a GGUF converted before a child starts); the engine
    # loads the weights from that directory, and with a child this process the tokenizer.
    source, name = which or (cfg.model, cfg.served_model_name)
    if not is_scripted(source):
        path, default_name = resolve_model_path(source, cfg.offline)
        source, name = str(path), name or default_name
    version = weights or INITIAL_WEIGHTS
    spec = EngineSpec(source, name, cfg.engine, log_level, weights_path, version, adapters=adapters)
    if not cfg.engine_process:
        model, engine = build_engine(spec)
        return model, EngineClient(ThreadTransport(engine))
    proc = ProcessTransport(spec)
    proc.spawn()
    model = load_model(source, name, cfg.engine.max_model_len, weights=False)
    proc.wait_ready()
    if proc.vocab_size != len(model.vocab):  # the weights' embedding size rules
        vocab = build_vocabulary(model.tokenizer, max(proc.vocab_size, len(model.tokenizer)))
        model = replace(model, vocab=vocab)
    return replace(model, model=None), EngineClient(proc)


def start_encoder(cfg: ServerConfig, slot: ModelSlot) -> tuple[LoadedModel, EngineClient]:
    """An encoder embedding model's tokenizer and facts, and its client over a thread of this
    process that runs its forward (transport/encoder.py): rows per batch within
    --max-num-seqs, padded tokens within ENCODER_BATCH_TOKENS or one input at the context."""
    from omlx_logprobs.models.loader import load_model
    from omlx_logprobs.transport.client import EngineClient
    from omlx_logprobs.transport.encoder import EncoderTransport

    assert slot.source is not None and slot.embedding is not None
    model = load_model(slot.source, slot.name, cfg.engine.max_model_len, weights=False)
    pad = model.tokenizer.pad_token_id
    transport = EncoderTransport(
        model.path,
        slot.embedding.pooling,
        0 if pad is None else int(pad),
        cfg.engine.max_num_seqs,
        max(ENCODER_BATCH_TOKENS, model.max_model_len),
        cfg.engine.dtype,
    )
    return model, EngineClient(transport)


def mlx_environment() -> None:
    """MLX settings read from the environment, unless already set there; before MLX first
    uses a GPU."""
    for key, value in MLX_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        mlx_environment()
        try:
            cfg = config_from_args(args)
        except ValueError as e:
            parser.error(str(e))
        from omlx_logprobs.distributed.group import launched

        if launched():  # one rank of a group started by mlx.launch
            group_cfg = _group_config(cfg, args, parser)
            if group_cfg is None:  # a rank other than 0: it serves nothing itself
                _exit(_follow(args))
            cfg = group_cfg
        code = 0
        try:
            # uvicorn re-raises the signal after its graceful shutdown; SIGINT's re-raise did not
            # always come back as KeyboardInterrupt (exit 0 seen in the suite), so SIGINT is
            # also read from the signals the server recorded.
            code = 130 if signal.SIGINT in serve(cfg, args) else 0
        except KeyboardInterrupt:
            code = 130
        except FileNotFoundError as e:  # a --model that is not there, or not downloadable
            log.error("%s", e)
            code = 2
        _exit(code)


def _exit(code: int) -> NoReturn:
    # Everything is stopped and joined by now. Skip interpreter teardown: destroying MLX's
    # native stream threads at exit aborts the process ("terminate called without an active
    # exception", status -6) after async evaluation was used.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _group_config(
    cfg: ServerConfig, args: argparse.Namespace, parser: argparse.ArgumentParser
) -> ServerConfig | None:
    """Under mlx.launch: rank 0's config (the model split over the group), or None on the
    other ranks."""
    from omlx_logprobs.distributed.group import rank_from_env

    if cfg.other_models:
        parser.error("a model split over processes is served alone: give --model once")
    if cfg.model is None or cfg.model.endswith(".json"):
        parser.error("a model split over processes needs --model (an mlx-lm directory)")
    if rank_from_env() != 0:
        return None
    if cfg.engine.prefix_cache_mib != 0:
        log.info("prefix cache off: the model is split over processes (docs/distributed.md)")
    engine = replace(cfg.engine, parallel=args.parallel, prefix_cache_mib=0)
    return replace(cfg, engine=engine)


def _follow(args: argparse.Namespace) -> int:
    """A rank other than 0: its share of the model, following rank 0 until rank 0 stops."""
    from omlx_logprobs.distributed.distributed import follower_main
    from omlx_logprobs.distributed.group import rank_from_env
    from omlx_logprobs.models.loader import resolve_model_path

    # Ctrl-C reaches every process of the group: rank 0 stops the others itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fmt = f"%(levelname)s %(name)s[rank {rank_from_env()}]: %(message)s"
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(fmt))
    cfg = config_from_args(args)
    path, _ = resolve_model_path(cfg.model, cfg.offline)
    engine = replace(cfg.engine, parallel=args.parallel, prefix_cache_mib=0)
    return follower_main(str(path), engine)


if __name__ == "__main__":
    main()
