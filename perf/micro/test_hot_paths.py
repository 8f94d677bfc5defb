"""Microbenchmarks of per-token hot paths (pytest-benchmark). Not part of `make test` (pytest's
testpaths is tests/); run them with `python -m pytest perf/micro --benchmark-only`.
Each benchmark does one batch's or one token's worth of work, so its time reads per unit."""

from __future__ import annotations

import pytest
from tandem.engines.base import EngineOutput
from tandem.frontend import sse
from tandem.runtime import wire as P
from tandem.worker.deltas import DeltaMaker
from tandem.worker.outbox import Outbox

BATCH = 256


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tandem.engines.reference.checkpoint import write_tiny_model

    path = str(tmp_path_factory.mktemp("models") / "tiny")
    write_tiny_model(path, seed=0)
    return path


def test_delta_maker_make_cumulative(benchmark):
    """One output of a 64-token-old sequence -> one delta (cumulative mode slices by offset)."""
    ids = list(range(1000, 1065))

    def run() -> object:
        m = DeltaMaker("r", "cumulative")
        m.sent = 64
        return m.make(EngineOutput("r", ids, None, prompt_tokens=16, completion_tokens=65))

    assert benchmark(run) is not None


def test_delta_maker_make_incremental(benchmark):
    def run() -> object:
        m = DeltaMaker("r", "incremental")
        m.sent = 64
        return m.make(EngineOutput("r", [1064], None, prompt_tokens=16,
                                   completion_tokens=65))

    assert benchmark(run) is not None


def _deltas() -> P.Deltas:
    return P.Deltas([P.Delta(f"req-{i:06d}", 17, [1000 + i]) for i in range(BATCH)],
                    P.Load(BATCH, 0, 1000, 4096, 0))


def test_outbox_256_streams_four_steps_merged_into_one_message(benchmark):
    """A frontend that owes credit: 4 engine steps of 256 streams go into the outbox (merging
    into one delta per stream), then one message of them is taken."""
    steps = [[P.Delta(f"req-{i:06d}", 17 + s, [1000 + s]) for i in range(BATCH)]
             for s in range(4)]

    def run() -> int:
        box = Outbox(2, 0)
        box.in_flight = 2  # the window is full
        for step in steps:
            for d in step:
                box.add(P.Delta(d.rid, d.offset, list(d.token_ids)))
        box.credit(1)
        return len(box.take())

    assert benchmark(run) == BATCH


def test_protocol_encode_deltas_256(benchmark):
    msg = _deltas()
    payload = benchmark(P.encode, msg)
    assert len(payload) > BATCH


def test_protocol_decode_deltas_256(benchmark):
    payload = P.encode(_deltas())
    msg = benchmark(P.TO_FRONTEND.decode, payload)
    assert isinstance(msg, P.Deltas) and len(msg.items) == BATCH


def test_sse_chunk_text(benchmark):
    enc = sse.ChunkEncoder("chat", "chatcmpl-abcdef0123-1", 1700000000, "tiny")
    out = benchmark(enc.text, " token")
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")


def test_detokenizer_step_byte_level(benchmark, tokenizer_dir):
    from tandem.frontend.detokenizer import DetokenizerFactory
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    factory = DetokenizerFactory(tok)
    ids = tok.encode("The sea is wide and deep, and the waves roll on and on forever.").ids
    detok = factory.new()
    state = {"i": 0}

    def step() -> str:
        i = state["i"] = (state["i"] + 1) % len(ids)
        return detok.step([ids[i]])

    benchmark(step)


def test_mock_engine_256_streams_of_64(benchmark, tmp_path):
    """The mock engine (zero costs) driving 256 concurrent requests of 64 tokens, each step's
    outputs handed to one sink that makes deltas, as the worker does: one call = 16384 tokens."""
    import asyncio
    import json

    from tandem.engines.base import EngineRequest
    from tandem.engines.mock import MockEngine
    from tandem.runtime.wire import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 500, "max_position_embeddings": 256, "eos_token_id": 2}))

    class Sink:
        def __init__(self, mode: str) -> None:
            self.makers: dict[str, DeltaMaker] = {}
            self.mode = mode
            self.left = 256
            self.done = asyncio.get_running_loop().create_future()

        def on_step(self, outputs: list[EngineOutput]) -> None:
            for out in outputs:
                maker = self.makers.setdefault(out.rid, DeltaMaker(out.rid, self.mode))  # type: ignore[arg-type]
                maker.make(out)
                if out.finish_reason is not None:
                    self.left -= 1
            if not self.left and not self.done.done():
                self.done.set_result(None)

    async def run() -> int:
        eng = MockEngine(str(tmp_path), max_batch=256)
        await eng.start()
        try:
            sink = Sink(eng.output_mode)
            for i in range(256):
                eng.submit(EngineRequest(f"r{i}", [1, 2, 3, i], SamplingParams(max_tokens=64)),
                           sink)
            await sink.done
            return sum(m.sent for m in sink.makers.values())
        finally:
            await eng.shutdown()

    assert benchmark.pedantic(lambda: asyncio.run(run()), rounds=5, iterations=1) == 256 * 64
