"""The `--suite app` servers of bench_http_servers.py: tandem's real FrontendApp over an in-process
fake pool (one-token deltas into each request's real DeltaCollector, the next one a loop pass after
the last was taken; no worker), served by tandem's uvicorn adapter or by granian's embedded server
in the same loop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any


def _frontend_app() -> Any:
    """tandem's real FrontendApp over an in-process pool that streams one-token deltas."""
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tandem.frontend.app import FrontendApp
    from tandem.frontend.preprocess import Preprocessor
    from tandem.config import FrontendConfig
    from tandem.runtime.collector import DeltaCollector
    from tandem.runtime.metrics import Registry
    from tandem.runtime.wire import Delta

    model = Path(tempfile.mkdtemp(prefix="bench-model-"))
    tok = Tokenizer(models.BPE())  # byte-level BPE, as the tiny model's
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(model / "tokenizer.json"))
    token: int = tok.token_to_id("a") or 0

    class Collector(DeltaCollector):
        """Hands out one-token deltas: the next one a loop pass after the last was taken."""

        __slots__ = ("rid", "n", "i")

        def __init__(self, rid: str, n: int) -> None:
            super().__init__()
            self.rid, self.n, self.i = rid, n, 0

        def take(self) -> Delta | None:
            return self._taken(super().take())

        def take_running(self) -> Delta | None:  # (a checkout without it never calls it)
            return self._taken(super().take_running())

        def _taken(self, d: Delta | None) -> Delta | None:
            if d is not None and self.i < self.n:
                asyncio.get_running_loop().call_soon(self.next)
            return d

        def next(self) -> None:
            self.i += 1
            self.put(Delta(self.rid, self.i - 1, [token], "length" if self.i == self.n else None))

    class Handle:
        def __init__(self, rid: str, n: int):
            self.rid = rid
            self.collector = Collector(rid, n)

        async def __aenter__(self) -> Handle:
            self.collector.next()
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        def enter_now(self) -> bool:
            return False

        def release(self) -> None:
            return None

    class Pool:
        registry = Registry()
        max_context = 1 << 20
        n = 0

        def ready(self) -> bool:
            return True

        async def snapshot(self) -> list[dict[str, Any]]:
            return []

        def open(self, prompt_ids: list[int], sampling: Any, session: str = "",
                 tenant: str = "", priority: int = 0, salt: str = "") -> Handle:
            self.n += 1
            return Handle(str(self.n), sampling.max_tokens)

    config = FrontendConfig(model=str(model), served_model_name="bench")
    return FrontendApp(config, Pool(), Preprocessor(model, "bench"))  # type: ignore[arg-type]


def serve_app(backend: str, port: int) -> None:
    """Serve the app through tandem's own adapter for `backend` (frontend/server.py)."""
    import uvloop

    from tandem.frontend.server import make_server

    async def main() -> None:
        server = make_server(_frontend_app(), "127.0.0.1", port, backend)  # type: ignore[arg-type]
        await server.start()
        await asyncio.Event().wait()

    uvloop.run(main())
