"""KV events against the REAL sglang package (0.5.23, installed without its CUDA deps): what SGLang's
own publisher sends (`--kv-events-config`), live and replayed, decodes with tandem's one decoder,
and what tandem publishes decodes with SGLang's own structs. So `--engine sglang` workers and
tandem's own publish one stream format."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq
import zmq.asyncio

from tandem.ports import free_port
from tandem.runtime.kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch, decode_live,
    decode_replay, encode_batch, replay_request,
)

sgl = pytest.importorskip(
    "sglang.srt.disaggregation.kv_events",
    reason="the real sglang package is not installed: pip install --no-deps -r "
           "tests/sglang/requirements.txt")

DEADLINE = 10.0
PAGE = list(range(200, 216))


def sglang_batch(i: int) -> object:
    return sgl.KVEventBatch(ts=float(i), events=[
        sgl.BlockStored(block_hashes=[-i - 1], parent_block_hash=None if i == 0 else -i,
                        token_ids=PAGE, block_size=16, lora_id=None,
                        medium=sgl.StorageMedium.GPU, cache_salt="salt", session_id="s1"),
        sgl.BlockRemoved(block_hashes=[-i - 1], medium=sgl.StorageMedium.CPU),
        sgl.AllBlocksCleared()])


def want(i: int) -> list[object]:
    return [BlockStored([-i - 1], None if i == 0 else -i, PAGE, 16, None, "GPU", None,
                        "salt"),  # (SGLang's cache_salt, carried: a router roots keys at it)
            BlockRemoved([-i - 1], "CPU_PINNED"), AllBlocksCleared()]


def test_sglang_payloads_decode_with_tandem() -> None:
    payload = msgspec.msgpack.Encoder().encode(sglang_batch(3))
    assert decode_batch(payload) == EventBatch(3.0, want(3), None)  # (the publisher sets a rank)


def test_tandem_payloads_decode_with_sglang_structs() -> None:
    ours = EventBatch(1.0, [BlockStored(block_hashes=[5, 6], parent_block_hash=4,
                                        token_ids=PAGE * 2, block_size=16),
                            BlockRemoved(block_hashes=[5]), AllBlocksCleared()])
    got = msgspec.msgpack.Decoder(sgl.KVEventBatch).decode(encode_batch(ours))
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockRemoved",
                                                      "AllBlocksCleared"]
    assert got.events[0].block_hashes == [5, 6] and got.events[0].token_ids == PAGE * 2
    assert got.attn_dp_rank == 0


async def test_sglang_publisher_live_and_replay_decode_with_tandem() -> None:
    port, replay_port = free_port(), free_port()
    config = json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True,
                         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
    publisher = sgl.EventPublisherFactory.create(config, attn_dp_rank=0)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{port}")
        n = 0
        async with asyncio.timeout(DEADLINE):
            while True:  # until the subscription has reached SGLang's PUB socket
                publisher.publish(sglang_batch(n))
                n += 1
                try:
                    live = decode_live(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                    break
                except TimeoutError:
                    continue
            while True:  # then every batch since, in order, up to the last one published
                assert live.batch == EventBatch(float(live.seq), want(live.seq), 0)
                if live.seq == n - 1:
                    break
                seq = live.seq
                live = decode_live(await sub.recv_multipart())
                assert live.seq == seq + 1
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart(replay_request(0))
        replayed = []
        async with asyncio.timeout(DEADLINE):
            while (item := decode_replay(await dealer.recv_multipart())) is not None:
                assert item.batch == EventBatch(float(item.seq), want(item.seq), 0)
                replayed.append(item.seq)
        assert replayed == list(range(n))
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        publisher.shutdown()


def test_kv_events_config_passes_through_to_sglang_and_is_advertised() -> None:
    pytest.importorskip("sglang.srt.server_args")
    from tandem.engines.sglang import SGLangOptions, build_server_args
    from tandem.worker.kv_events import sglang_event_addrs

    config = '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    args = ("--kv-events-config", config)
    assert build_server_args(SGLangOptions(model="/m", engine_args=args)).kv_events_config == config
    assert sglang_event_addrs(args, "10.0.0.7") == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
