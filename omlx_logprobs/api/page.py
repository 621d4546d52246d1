"""The logprobs page at `/`: static files installed with the package (api/static/), one small
script of our own and nothing fetched from elsewhere, so it works offline. `/page/config` tells
the page, before any API call, whether it must ask for the API key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
# Reachable without the API key: the page and its assets hold no data; the calls it makes
# to the API carry the key.
OPEN_PATHS = frozenset({"/", "/page/config"})
OPEN_PREFIXES = ("/static/",)


def add_routes(app: FastAPI, api_key_required: bool) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        # no-cache: a browser revalidates, so a new install's page is not mixed with old assets
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    @app.get("/page/config", include_in_schema=False)
    async def config() -> dict[str, Any]:
        return {"api_key_required": api_key_required}
