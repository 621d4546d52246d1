"""The reliability tests' model: the tiny model under its served name. Their servers (a process, or
`create_app` under uvicorn in a thread), /health polling and the fault wrappers: tests/helpers/."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.server import TINY_NAME


@pytest.fixture(scope="session")
def tiny_served(tiny: LoadedModel) -> LoadedModel:
    return replace(tiny, name=TINY_NAME)
