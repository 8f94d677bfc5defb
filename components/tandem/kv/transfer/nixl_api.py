"""The one module that imports NIXL, lazily (tandem runs without it): NIXL's Python API and its
bindings, for tandem's own KV transfer (`kv/transfer/nixl.py`) and for SGLang's CPU engine, whose
NIXL calls tandem corrects in SGLang's scheduler process (`engines/sglang_cpu.py`)."""

from __future__ import annotations

from typing import Any


def load() -> tuple[Any, Any]:
    """(nixl._api, nixl._bindings); ImportError when NIXL is not installed."""
    from nixl import _api, _bindings

    return _api, _bindings
