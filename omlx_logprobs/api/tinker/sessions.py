"""What the Tinker routes remember between calls: sessions (made by the SDK's ServiceClient,
kept alive by its heartbeats), the training models made in them (`create_model`: one training
run each in the engine of the base model, training/trainer.py), and the samplers
(`save_weights_for_sampler`, `create_sampling_session`): a base model and, for trained
weights, the name of the adapter the engine serves them under.

A session unheard of (no heartbeat, no call naming it or its models) for its bound ends as a
finished one does (api/tinker/expiry.py): the SDK heartbeats every HEARTBEAT_S (its
SESSION_HEARTBEAT_PERIOD_SEC), and after 120 s without an answer warns that the session will
be terminated; `--tinker-session-timeout` sets another bound.

A training model's calls run one at a time in the order they arrived (`lock`), as the SDK
numbers them; a model's unnamed sampler snapshots beyond SNAPSHOTS are unloaded, oldest
first, so that an RL loop saving one a step keeps a bounded number of adapters."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.training.calls import LoraSpec

SNAPSHOTS = 4
HEARTBEAT_S = 10.0


@dataclass
class TrainingModel:
    model_id: str
    base: str  # the served model it trains on
    lora: LoraSpec
    layers: list[str]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    snapshots: deque[str] = field(default_factory=deque)  # unnamed samplers' adapters
    created: float = field(default_factory=time.time)  # wall-clock seconds, for the listings
    user_metadata: dict[str, str] | None = None  # create_model's (or load_weights'), listed


@dataclass(frozen=True)
class Sampler:
    sampler_id: str
    base: str
    adapter: str | None  # None: the base model
    path: str | None  # the tinker:// path it was made from
    created: float = field(default_factory=time.time)
    expires_at: float | None = None  # wall-clock seconds: the path's time to live, if given
    user_metadata: dict[str, str] | None = None  # save_weights_for_sampler's, listed


@dataclass
class Session:
    session_id: str
    last_seen: float
    user_metadata: dict[str, str] | None = None  # create_session's, for the REST client
    display_name: str | None = None


def metadata(given: dict[str, Any] | None) -> dict[str, str] | None:
    """User metadata as Tinker's answers carry it (strings: the requests allow any values)."""
    if given is None:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in given.items()}


class Sessions:
    def __init__(self, expire_s: float = 12 * HEARTBEAT_S) -> None:
        self.expire_s = expire_s  # a session unheard of this long ends (api/tinker/expiry.py)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.paths: dict[str, Sampler] = {}  # tinker:// path -> its sampler
        self.finished: set[str] = set()

    def open(
        self, user_metadata: dict[str, Any] | None = None, display_name: str | None = None
    ) -> str:
        sid = f"session-{uuid.uuid4().hex[:16]}"
        self.sessions[sid] = Session(sid, time.monotonic(), metadata(user_metadata), display_name)
        return sid

    def described(self, sid: str) -> dict[str, Any]:
        """A live session as the REST client's get_session reads it: its training runs and
        samplers (a finished one is a 410, as for its heartbeat)."""
        s = self.session(sid)
        runs = sorted(k for k in self.models if k.startswith(f"{sid}:"))
        samplers = sorted(k for k, v in self.samplers.items()
                          if v.adapter is not None and v.adapter.startswith(f"{sid}:"))  # fmt: skip
        return {"training_run_ids": runs, "sampler_ids": samplers,
                "user_metadata": s.user_metadata, "display_name": s.display_name}  # fmt: skip

    def session(self, sid: str) -> Session:
        """A live session; a 410 for a finished one (the SDK stops its heartbeats then)."""
        if sid in self.finished:
            raise APIError(f"the session {sid!r} has finished", param="session_id", status=410)
        s = self.sessions.get(sid)
        if s is None:
            raise APIError(f"no session {sid!r}", param="session_id", status=404)
        s.last_seen = time.monotonic()
        return s

    def finish(self, sid: str) -> list[TrainingModel]:
        """End a session: its training models, which the caller drops from their engines."""
        self.session(sid)
        del self.sessions[sid]
        self.finished.add(sid)
        ids = [k for k in self.models if k.startswith(f"{sid}:")]
        return [self.models.pop(k) for k in ids]

    def model(self, model_id: str) -> TrainingModel:
        m = self.models.get(model_id)
        if m is None:
            raise APIError(
                f"no training model {model_id!r} (create_model makes one)", param="model_id"
            )
        if (s := self.sessions.get(model_id.split(":", 1)[0])) is not None:
            s.last_seen = time.monotonic()  # a call on its model: the session is alive
        return m

    def expired(self) -> list[str]:
        """The live sessions unheard of for `expire_s`."""
        before = time.monotonic() - self.expire_s
        return [sid for sid, s in self.sessions.items() if s.last_seen < before]

    def sampler(self, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is None:
            raise APIError(f"no sampler {sampler_id!r}", param="sampling_session_id")
        return s

    def by_path(self, path: str) -> Sampler:
        s = self.live_paths().get(path)
        if s is None:
            raise APIError(
                f"no weights saved at {path!r} on this server (save_weights_for_sampler"
                " makes them)",
                param="model_path",
            )
        return s

    def live_paths(self) -> dict[str, Sampler]:
        """The named sampler weights within their time to live (past it, a path names nothing;
        the weights stay loaded for the samplers made from them, until their session ends)."""
        now = time.time()
        return {p: s for p, s in self.paths.items() if s.expires_at is None or now < s.expires_at}

    def add_sampler(
        self,
        base: str,
        adapter: str | None,
        path: str | None,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> Sampler:
        end = None if ttl_seconds is None else time.time() + ttl_seconds
        s = Sampler(f"sampler-{uuid.uuid4().hex[:16]}", base, adapter, path, expires_at=end,
                    user_metadata=metadata(user_metadata))  # fmt: skip
        self.samplers[s.sampler_id] = s
        if path is not None:
            self.paths[path] = s
        return s

    def set_ttl(self, path: str, ttl_seconds: int | None) -> None:
        """A new end for named sampler weights (None: they stay while their session lives)."""
        s = self.by_path(path)
        end = None if ttl_seconds is None else time.time() + ttl_seconds
        self.paths[path] = self.samplers[s.sampler_id] = replace(s, expires_at=end)

    def forget_adapter(self, adapter: str) -> None:
        """An unloaded adapter's samplers go (later samples on them are 400s)."""
        for sid in [k for k, s in self.samplers.items() if s.adapter == adapter]:
            gone = self.samplers.pop(sid)
            if gone.path is not None:
                self.paths.pop(gone.path, None)
