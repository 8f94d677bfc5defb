"""Shared fixtures: a tiny model written once per session by our own code, and real clusters."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster import Cluster


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
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


_OLD_ZMQ_CONTEXTS: list[object] = []  # kept: collecting or terminating a wedged one would block


@pytest.fixture(autouse=True)
def _fresh_zmq_context() -> Iterator[None]:
    """Each test's in-process ZMQ sockets get a context of their own. Seen in full runs: after a
    reference PD test hung (its decode side's new bootstrap connection never connected), every
    later test that used ZMQ in this process failed the same way, as if the shared context's I/O
    thread no longer served new connections. The old context is left as it is (sockets a
    longer-lived fixture made keep working on it); it is not terminated, which could block."""
    from tandem.runtime import transport

    yield
    ctx = transport._ctx
    if ctx is not None:
        _OLD_ZMQ_CONTEXTS.append(ctx)
        transport._ctx = None
