"""The `ServerConfig` the `serve` command's flags make (options.py parses them): each config
record built from its flags, out-of-range values refused by the records themselves."""

from __future__ import annotations

import argparse
from pathlib import Path

from omlx_logprobs.config import (
    Access,
    BatchConfig,
    EngineConfig,
    Limits,
    PoolConfig,
    ServerConfig,
    TinkerConfig,
)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError for any value out of range."""
    models: list[str | None] = list(args.model or [None])
    names: list[str | None] = list(args.served_model_name or [])
    if len(names) > len(models):
        raise ValueError("--served-model-name is given more often than --model")
    names += [None] * (len(models) - len(names))
    return ServerConfig(
        lora=lora_args(args.lora or []),
        model=models[0],
        served_model_name=names[0],
        offline=args.offline,
        other_models=tuple(zip(models[1:], names[1:])),
        tasks=tuple(args.task or ()),
        pool=PoolConfig(
            args.max_loaded_models, args.max_model_memory_mib, args.model_load_timeout_s
        ),
        host=args.host,
        port=args.port,
        engine=engine_config(args),
        limits=Limits(
            max_body_bytes=args.max_body_bytes,
            max_queued=args.max_queued_requests,
            max_output_tokens=args.max_output_tokens,
            max_n=args.max_n,
            max_stop=args.max_stop,
            max_stop_chars=args.max_stop_chars,
            max_stop_token_ids=args.max_stop_token_ids,
            max_logprob_token_ids=args.max_logprob_token_ids,
            max_image_pixels=args.max_image_pixels,
            max_images=args.max_images,
            allowed_local_media_path=args.allowed_local_media_path,
            allow_image_urls=args.allow_image_urls,
            image_fetch_s=args.image_fetch_timeout,
        ),
        access=Access(
            api_key=args.api_key or None,
            allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        ),
        batches=BatchConfig(args.batch_dir, args.batch_concurrency, args.max_file_bytes),
        tinker=TinkerConfig(args.tinker_dir, args.tinker_session_timeout),
        shutdown_grace_s=args.shutdown_grace,
        engine_process=args.engine == "process",
        metrics=args.metrics,
        faithful_answers=args.faithful_answers,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's part of the flags; the prefill's defaults depend on the device, and the
    engine resolves them (EngineConfig.prefill)."""
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        prefill_chunk=args.prefill_chunk,
        max_top_logprobs=args.max_logprobs,
        flat_logprobs=args.flat_logprobs,
        return_routed_experts=args.enable_return_routed_experts,
        max_model_len=args.max_model_len,
        logprobs_mode=args.logprobs_mode,
        cache_limit_mib=args.mlx_cache_limit_mib,
        prefix_cache_mib=args.prefix_cache_mib,
        kv_cache_dir=args.kv_cache_dir,
        kv_cache_disk_mib=args.kv_cache_disk_mib,
        dtype=args.dtype,
        prefill_delay_ms=args.prefill_delay_ms,
        group_timeout_s=args.group_timeout_s,
        speculate=args.speculate or ("draft" if args.draft_model else "prediction"),
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        speculate_max_batch=args.speculate_max_batch,
        batch_invariant=args.batch_invariant,
        reasoning_budgets=reasoning_budgets(args.reasoning_budgets),
    )


def reasoning_budgets(value: str | None) -> tuple[tuple[str, int], ...]:
    """`--reasoning-budgets low=1024,medium=4096` as ((effort, budget), ...); ValueError for a
    malformed entry (EngineConfig checks the names and values)."""
    out: dict[str, int] = {}
    for item in (value or "").split(","):
        if not item.strip():
            continue
        effort, eq, budget = item.strip().partition("=")
        if not (eq and budget.strip().isdigit()):
            raise ValueError(f"--reasoning-budgets takes EFFORT=TOKENS,..., not {item!r}")
        out[effort.strip()] = int(budget)
    return tuple(out.items())


def lora_args(values: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=PATH values as (name, absolute path); ValueError for a malformed one."""
    out: dict[str, str] = {}
    for v in values:
        name, eq, path = v.partition("=")
        if not (name and eq and path):
            raise ValueError(f"--lora takes NAME=PATH, not {v!r}")
        if name in out:
            raise ValueError(f"--lora {name} is given twice")
        out[name] = str(Path(path).expanduser().absolute())
    return tuple(out.items())
