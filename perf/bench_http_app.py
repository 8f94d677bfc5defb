"""The `--suite app` servers of bench_http_servers.py: tandem's real FrontendApp over an in-process
fake pool (one-token deltas, an event-loop yield between them, no worker), served by tandem's
uvicorn adapter or by granian's embedded server in the same loop."""

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
    from tandem.runtime.wire import Delta, WorkerInfo

    model = Path(tempfile.mkdtemp(prefix="bench-model-"))
    tok = Tokenizer(models.BPE())  # byte-level BPE, as the tiny model's
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 10, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(model / "tokenizer.json"))
    token = tok.token_to_id("a")

    class Stream:
        def __init__(self, rid: str, n: int):
            self.rid, self.n, self.i = rid, n, 0

        async def __aenter__(self) -> Stream:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        def __aiter__(self) -> Stream:
            return self

        def waiting(self) -> int:
            return 0  # every delta after the first comes one loop pass later

        async def __anext__(self) -> Delta:
            if self.i >= self.n:
                raise StopAsyncIteration
            if self.i:
                await asyncio.sleep(0)
            self.i += 1
            return Delta(self.rid, self.i - 1, [token], "length" if self.i == self.n else None)

    class Pool:
        info = WorkerInfo("bench", "agg", "fake", "bench", 16, 1 << 20, 1 << 20)
        n = 0

        def ready(self) -> bool:
            return True

        async def snapshot(self) -> list[dict[str, Any]]:
            return []

        def open(self, prompt_ids: list[int], sampling: Any) -> Stream:
            self.n += 1
            return Stream(str(self.n), sampling.max_tokens)

        def metrics(self) -> str:
            return ""

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
