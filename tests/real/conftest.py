"""transformers' own greedy answers on the real model (tests/conftest.py's `smollm2`), the
reference every tandem answer is compared with."""

from __future__ import annotations

import pytest

from tests.transformers_ref import Transformers


@pytest.fixture(scope="session")
def hf(smollm2: str) -> Transformers:
    return Transformers(smollm2)
