"""`GET /metrics` in Prometheus' text format, behind the API key as every route but /health;
the count of HTTP requests by route and status (an ASGI middleware outside the guard, so its
401s and 429s count too); each model's engine client observed (api/metrics/observer.py),
models loaded later included."""

from __future__ import annotations

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omlx_logprobs.api.core.pool import ModelPool
from omlx_logprobs.api.metrics.engines import EngineCollector
from omlx_logprobs.api.metrics.families import Families
from omlx_logprobs.api.metrics.observer import RequestObserver

UNMATCHED = "unmatched"  # a path no route serves: one label, however many such paths come
# Any other method a client sends is counted as "OTHER": a label's values stay few.
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class CountRequests:
    """Counts each response by its route's path template (never the raw path: the labels stay
    bounded), its method and status, when its head is sent."""

    def __init__(self, app: ASGIApp, counter: Counter, routes: list[BaseRoute]) -> None:
        self.app = app
        self.counter = counter
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = _template(scope, self.routes)
                method = scope["method"] if scope["method"] in METHODS else "OTHER"
                self.counter.labels(route, method, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _template(scope: Scope, routes: list[BaseRoute]) -> str:
    """The routed request's template; before routing (the guard answered), the route that
    would have served it."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in routes if r.matches(scope)[0] is not Match.NONE), None)
    return str(getattr(route, "path", UNMATCHED))


def install_metrics(app: FastAPI, pool: ModelPool) -> None:
    registry = CollectorRegistry()
    families = Families(registry)
    registry.register(EngineCollector(pool))
    for slot in pool.slots.values():
        slot.observer = RequestObserver(families, slot.name)
        if slot.served is not None:
            slot.served.engine.observer = slot.observer
    app.add_middleware(CountRequests, counter=families.http, routes=app.router.routes)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
