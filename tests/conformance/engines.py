"""The engines the conformance suite runs against: name -> async factory.

A factory builds an engine, not started, for a role:
- "agg": an aggregated engine;
- "prefill" / "decode": the two halves of a PD pair that talk through `link` (a `PdLink`: the
  prefill side's bootstrap port, and the in-process fabric KV moves over); a factory that cannot
  do PD in one process calls `pytest.skip`;
- "broken": an engine whose `start()` fails.
Options every factory takes: `output_mode` (None: the engine's own default), `num_pages`,
`page_size`. To add an engine, add a
factory here (an engine that needs a GPU skips itself where there is none).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem import launcher
from tandem.engines.base import Engine
from tandem.engines.handoff import HandoffConfig
from tandem.kv.transfer.movers import KvMover, LocalFabric, LocalMover, SimulatedMover
from tandem.runtime.errors import EngineError
from tandem.runtime.wire import Bootstrap

HOST = "127.0.0.1"


def free_port() -> int:
    return launcher.free_port(HOST)


@dataclass
class PdLink:
    """What the two halves of an in-process PD pair share."""

    port: int = field(default_factory=free_port)
    fabric: LocalFabric = field(default_factory=LocalFabric)
    rooms: int = 0
    timeout_s: float = 30.0  # room, done and transfer deadlines

    def bootstrap(self) -> Bootstrap:
        self.rooms += 1
        return Bootstrap(HOST, self.port, self.rooms)

    def handoff(self, role: str, name: str, local_kv: bool) -> HandoffConfig:
        def mover(kv: Any, page_bytes: int, num_pages: int) -> KvMover:
            if local_kv:
                return LocalMover(self.fabric, name, kv, page_bytes, num_pages)
            return SimulatedMover(name, page_bytes, num_pages)

        return HandoffConfig(role=role, name=name, make_mover=mover,  # type: ignore[arg-type]
                             room_timeout_s=self.timeout_s, done_timeout_s=self.timeout_s,
                             transfer_timeout_s=self.timeout_s, host=HOST,
                             port=self.port if role == "prefill" else 0)


class _Broken:
    """A handoff whose construction fails: start() fails after the engine began starting."""

    def build(self, host: Any, memory: Any) -> Any:
        raise EngineError("this engine was built not to start")


Factory = Callable[..., Awaitable[Engine]]
Make = Callable[..., Awaitable[Engine]]  # the `make` fixture (conftest.py): a factory's engine, started


async def mock(model_dir: Path, role: str = "agg", *, link: PdLink | None = None,
               output_mode: str | None = None, num_pages: int = 64,
               page_size: int = 4) -> Engine:
    from tandem.engines.mock import MockEngine

    handoff: Any = None
    if role == "broken":
        handoff = _Broken()
    elif role != "agg":
        assert link is not None
        handoff = link.handoff(role, f"mock-{role}", local_kv=False)
    return MockEngine(str(model_dir), page_size=page_size, num_pages=num_pages,
                      output_mode=output_mode, handoff=handoff)  # type: ignore[arg-type]


async def reference(model_dir: Path, role: str = "agg", *, link: PdLink | None = None,
                    output_mode: str | None = None, num_pages: int = 64,
                    page_size: int = 4) -> Engine:
    from tandem.engines.reference import ReferenceEngine

    handoff: Any = None
    if role == "broken":
        handoff = _Broken()
    elif role != "agg":
        assert link is not None
        handoff = link.handoff(role, f"reference-{role}", local_kv=True)
    return ReferenceEngine(model_dir, page_size=page_size, num_pages=num_pages,
                           output_mode=output_mode, handoff=handoff)  # type: ignore[arg-type]


_SGLANG_WORLDS: dict[int, tuple[PdLink, Any]] = {}  # one fake SGLang world per PD link


async def sglang_fake(model_dir: Path, role: str = "agg", *, link: PdLink | None = None,
                      output_mode: str | None = None, num_pages: int = 64,
                      page_size: int = 4) -> Engine:
    """The SGLang adapter over the fake sglang.Engine (PD through the fake's bootstrap rooms)."""
    from tandem.engines.sglang import OUTPUT_MODE, SGLangEngine, SGLangOptions
    from tests.sglang.fake_sglang import World, fake_server_args

    world = World() if link is None else _SGLANG_WORLDS.setdefault(id(link), (link, World()))[1]
    factory: Any = world.factory
    if role == "broken":
        role = "agg"

        def factory(server_args: Any) -> Any:
            raise EngineError("this engine was built not to start")

    opts = SGLangOptions(str(model_dir), role=role,  # type: ignore[arg-type]
                         output_mode=output_mode or OUTPUT_MODE,  # type: ignore[arg-type]
                         page_size=page_size, num_pages=num_pages, host=HOST,
                         bootstrap_port=link.port if link is not None and role == "prefill" else 0,
                         engine_args=("--enable-deterministic-inference",))  # seeds are used
    return SGLangEngine(opts, engine_factory=factory, server_args_builder=fake_server_args)


ENGINES: dict[str, Factory] = {"mock": mock, "reference": reference, "sglang-fake": sglang_fake}
