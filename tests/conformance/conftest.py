"""The conformance suite's one fixture: `make`, parametrized over every engine in engines.ENGINES."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tandem.engines.base import Engine
from tests.conformance.engines import ENGINES, Make


@pytest.fixture(params=sorted(ENGINES))
async def make(request: pytest.FixtureRequest, tiny_model: str) -> AsyncIterator[Make]:
    """Builds (and starts, unless told not to) engines of one kind; shuts them all down."""
    factory = ENGINES[request.param]
    made: list[Engine] = []

    async def build(role: str = "agg", start: bool = True, **kw: Any) -> Engine:
        engine = await factory(Path(tiny_model), role, **kw)
        made.append(engine)
        if start:
            await engine.start()
        return engine

    yield build
    for engine in made:
        await engine.shutdown()
