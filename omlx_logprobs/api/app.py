"""The app: every API's routes (each package's `routes.py`: openai/, responses/, anthropic/,
ollama/, rl/, tinker/, scoring/, admin/, batches/) on one pool of models, behind the guard,
with each API's error shape."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from omlx_logprobs.api.admin import page
from omlx_logprobs.api.admin import routes as admin
from omlx_logprobs.api.admin.openapi import install_openapi
from omlx_logprobs.api.anthropic import routes as anthropic
from omlx_logprobs.api.batches import routes as batches
from omlx_logprobs.api.batches.runner import BatchRunner
from omlx_logprobs.api.core.errors import error_response, install_error_handlers
from omlx_logprobs.api.core.pool import ModelPool, Unavailable
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.guard import install_guard
from omlx_logprobs.api.metrics.routes import install_metrics
from omlx_logprobs.api.ollama import routes as ollama
from omlx_logprobs.api.openai import routes as openai
from omlx_logprobs.api.responses import routes as responses
from omlx_logprobs.api.responses.socket import add_socket
from omlx_logprobs.api.responses.store import ResponseStore
from omlx_logprobs.api.rl import routes as rl
from omlx_logprobs.api.scoring import routes as scoring
from omlx_logprobs.api.scoring.template import YesNoTemplate
from omlx_logprobs.config import Access, BatchConfig, TinkerConfig

log = logging.getLogger("omlx_logprobs")


def create_app(
    served: Served | ModelPool,
    access: Access | None = None,
    rerank_template: YesNoTemplate | None = None,
    batch: BatchConfig | None = None,
    metrics: bool = True,
    tinker: TinkerConfig | None = None,
) -> FastAPI:
    """The app over one model (a `Served`) or several (a `ModelPool`, api/core/pool.py);
    `rerank_template`: what /rerank and /score write each pair into (default: Qwen3-Reranker's
    prompt, api/scoring/template.py); `batch`: where the Batch API keeps its files; `metrics`:
    whether GET /metrics is served (and requests observed for it); `tinker`: where Tinker's
    checkpoints go and when its sessions expire (the default: a temporary folder, gone with the
    process, and 120 s)."""
    pool = served if isinstance(served, ModelPool) else ModelPool.single(served)
    batch = batch or BatchConfig()
    runner = BatchRunner(batch.dir, batch.concurrency, lambda: pool.closing)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool.start()
        runner.start(app)
        yield
        await runner.stop()  # before the engine stops: the lines in flight end unwritten
        pool.shutdown()
        runner.close()
        # the threads of `asyncio.to_thread` (model facts, batch files) end with the server
        await asyncio.get_running_loop().shutdown_default_executor()
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        log.info("stopped; threads left: %s", ", ".join(alive) or "none")

    access = access or Access()
    # /docs is served by install_openapi from installed assets; FastAPI's own pages use a CDN
    app = FastAPI(
        title="omlx_logprobs",
        description="OpenAI-compatible completions with exact logprobs. [The logprobs page](/)",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    install_openapi(app, access.api_key is not None)
    install_guard(app, access, pool.limits, pool.engine.max_num_seqs)
    if metrics:
        install_metrics(app, pool)  # outside the guard: its refusals count too

    @app.exception_handler(Unavailable)
    async def _unavailable(r: Request, e: Unavailable) -> JSONResponse:
        response = error_response(e, r.url.path)
        response.headers["Retry-After"] = str(e.retry_after_s)
        return response

    admin.add_routes(app, pool)
    openai.add_routes(app, pool, int(time.time()))
    rl.add_routes(app, pool)
    scoring.add_routes(app, pool, rerank_template or YesNoTemplate())
    stored = ResponseStore()
    responses.add_routes(app, pool, stored)
    add_socket(app, pool, stored)
    anthropic.add_routes(app, pool)
    _tinker_routes(app, pool, tinker or TinkerConfig())  # /api/v1/ before Ollama's /api/
    ollama.add_routes(app, pool)
    batches.add_routes(app, runner, batch.max_file_bytes)
    page.add_routes(app, access.api_key is not None)
    return app


def _tinker_routes(app: FastAPI, pool: ModelPool, tinker: TinkerConfig) -> None:
    """Tinker's routes, where its SDK is installed (it needs Python 3.11: pyproject.toml)."""
    if importlib.util.find_spec("tinker") is None:
        log.info("Tinker's API is off: the tinker package is not installed")
        return
    from omlx_logprobs.api.tinker import routes

    routes.add_routes(app, pool, tinker)
