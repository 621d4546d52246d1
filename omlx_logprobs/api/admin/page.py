"""The logprobs page at `/`: static files installed with the package (api/static/), one small
script of our own and nothing fetched from elsewhere, so it works offline. `/page/config` tells
the page, before any API call, whether it must ask for the API key.

The files are read once, when the app is made, and served from memory: a request names a key of
a dict, never a path, so no request reaches the file system."""

from __future__ import annotations

from collections.abc import Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Response

from omlx_logprobs.api.core.errors import APIError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

STATIC = resources.files("omlx_logprobs.api") / "static"
# Reachable without the API key: the page and its assets hold no data; the calls it makes
# to the API carry the key.
OPEN_PATHS = frozenset({"/", "/page/config"})
OPEN_PREFIXES = ("/static/",)
MEDIA_TYPES = {
    "html": "text/html; charset=utf-8",
    "css": "text/css; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "svg": "image/svg+xml",
    "png": "image/png",
}


class Assets:
    """Named files held in memory, each with its media type."""

    def __init__(self, root: Traversable, names: Iterable[str]) -> None:
        self.files = {
            name: (root.joinpath(name).read_bytes(), MEDIA_TYPES[name.rpartition(".")[2]])
            for name in names
        }

    @classmethod
    def folder(cls, root: Traversable) -> Assets:
        return cls(root, [f.name for f in root.iterdir() if f.is_file()])

    def response(self, name: str) -> Response:
        found = self.files.get(name)
        if found is None:
            raise APIError(f"No file `{name}` here.", status=404, code="not_found")
        body, media_type = found
        # no-cache: a browser revalidates, so a new install's page is not mixed with old assets
        return Response(body, media_type=media_type, headers={"cache-control": "no-cache"})


def add_routes(app: FastAPI, api_key_required: bool) -> None:
    assets = Assets.folder(STATIC)

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return assets.response("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return assets.response(name)

    @app.get("/page/config", include_in_schema=False)
    async def config() -> dict[str, Any]:
        return {"api_key_required": api_key_required}
