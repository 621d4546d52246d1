"""`omlx-logprobs serve`: load a model and serve it over HTTP."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import omlx_logprobs
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.parsing.thinking import ReasoningParser, parser_enabled

log = logging.getLogger("omlx_logprobs")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omlx-logprobs")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    s.add_argument(
        "--model",
        default=None,
        help="mlx-lm model directory, .gguf file or scripted model description (.json);"
        " default: the embedded SmolLM2-135M-Instruct",
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--prefill-chunk", type=int, default=512)
    s.add_argument("--max-top-logprobs", type=int, default=20)
    s.add_argument(
        "--prefill-delay-ms",
        type=float,
        default=None,
        help="while a batch decodes, how long a new prompt may wait to prefill together with"
        " others (default: 20 on a GPU, 0 on the CPU)",
    )
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument(
        "--reasoning-parser",
        choices=[m.value for m in ReasoningParser],
        default=ReasoningParser.AUTO.value,
        help="split <think> reasoning from the answer: auto (when the model has think markers),"
        " think (always) or none",
    )
    s.add_argument(
        "--logprobs-mode",
        choices=["raw_logprobs", "processed_logprobs"],
        default="raw_logprobs",
        help="what logprobs describe when a request names no logprobs_mode",
    )
    s.add_argument("--log-level", default="info")
    return p


def serve(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import uvicorn

    from omlx_logprobs.api.app import create_app
    from omlx_logprobs.api.serving import Served
    from omlx_logprobs.engine.engine import Engine
    from omlx_logprobs.models.loader import load_model

    # On a GPU a prefill forward costs about as much host time as a decode step, so prompts
    # are gathered; on the CPU the step itself is far longer than any useful delay.
    gpu_delay = 0.0 if mx.default_device() == mx.cpu else 20.0
    cfg = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        prefill_chunk=args.prefill_chunk,
        max_top_logprobs=args.max_top_logprobs,
        max_model_len=args.max_model_len,
        logprobs_mode=args.logprobs_mode,
        prefill_delay_ms=args.prefill_delay_ms if args.prefill_delay_ms is not None else gpu_delay,
    )
    log.info("BLAS: %s", omlx_logprobs.BLAS)
    model = load_model(args.model, args.served_model_name, cfg.max_model_len)
    log.info(
        "model %s from %s (vocab %d, context %d)",
        model.name,
        model.path,
        len(model.vocab),
        model.max_model_len,
    )
    # The engine thread needs the GIL back promptly after each device wait; the default 5 ms
    # switch interval lets a busy event loop hold it for a whole decode step.
    sys.setswitchinterval(float(os.environ.get("OMLX_SWITCH_INTERVAL", "0.005")))
    reasoning = parser_enabled(ReasoningParser(args.reasoning_parser), model.tokenizer)
    log.info("reasoning parser: %s", "on" if reasoning else "off")
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg)
    app = create_app(Served(engine, model, cfg, reasoning=reasoning))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        serve(args)


if __name__ == "__main__":
    main()
