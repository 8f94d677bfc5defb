"""Pure checks of the worker and KV side: what a Generate may carry (tandem.worker.validate), what
a KvHello/KvRoom may announce (tandem.kv.bootstrap.checks), and which interface UCX is kept on for an
advertised address (tandem.kv.transfer.net)."""

from __future__ import annotations

import math
import socket
from collections import namedtuple

import pytest

from tandem.kv.bootstrap.checks import MAX_PEER_PAGES, check_hello, check_room
from tandem.kv.transfer.net import bind_ucx_to, net_device_for
from tandem.runtime import wire
from tandem.runtime.wire import Bootstrap, Generate, KvHello, KvLayout, KvRoom, SamplingParams
from tandem.worker.validate import Limits, check_generate

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
AF_LINK = getattr(socket, "AF_PACKET", 17)
IFACES = {
    "lo": [Addr(socket.AF_INET, "127.0.0.1", None, None, None),
           Addr(socket.AF_INET6, "::1", None, None, None)],
    "eth0": [Addr(AF_LINK, "52:54:00:12:34:56", None, None, None),
             Addr(socket.AF_INET, "10.1.2.3", None, None, None),
             Addr(socket.AF_INET6, "fe80::5054:ff:fe12:3456%eth0", None, None, None)],
    "eth1": [Addr(socket.AF_INET, "192.168.7.9", None, None, None)],
}


@pytest.mark.parametrize("host, want", [
    ("10.1.2.3", "eth0"),
    ("192.168.7.9", "eth1"),
    ("127.0.0.1", "lo"),
    ("::1", "lo"),
    ("[fe80::5054:ff:fe12:3456]", "eth0"),
    ("10.9.9.9", None),  # no interface holds it
    ("0.0.0.0", None),  # unspecified: UCX's own choice
    ("", None),
])
def test_the_interface_holding_the_advertised_address(host: str, want: str | None) -> None:
    assert net_device_for(host, IFACES) == want


def test_rdma_ports_stay_usable_and_an_operator_setting_wins() -> None:
    assert net_device_for("10.1.2.3", IFACES, ["mlx5_1:1", "mlx5_0:1"]) == \
        "eth0,mlx5_0:1,mlx5_1:1"
    env = {"UCX_NET_DEVICES": "mlx5_0:1"}
    assert bind_ucx_to("127.0.0.1", env) == "mlx5_0:1" and env == {"UCX_NET_DEVICES": "mlx5_0:1"}
    env = {}
    assert bind_ucx_to("127.0.0.1", env) == "lo" and env["UCX_NET_DEVICES"] == "lo"


LIMITS = Limits(vocab_size=100, max_context=64)


@pytest.mark.parametrize("g", [
    Generate("r", [1, 2], SamplingParams()),
    Generate("r", [99], SamplingParams(max_tokens=1, top_k=5, seed=2**64 - 1, temperature=0.0)),
    Generate("r", [0] * 64, SamplingParams(stop_token_ids=(1, 2)), Bootstrap("h", 1, 0)),
    Generate("r", [1, 2, 3], SamplingParams(), None, 2),  # a moved request: 2 ids were output
])
def test_acceptable_generates_pass(g: Generate) -> None:
    assert check_generate(g, LIMITS) is None


@pytest.mark.parametrize("g, words", [
    (Generate("", [1], SamplingParams()), "request id"),
    (Generate("r" * 300, [1], SamplingParams()), "request id"),
    (Generate("r", [], SamplingParams()), "empty"),
    (Generate("r", [0] * 65, SamplingParams()), "context"),
    (Generate("r", [100], SamplingParams()), "outside"),
    (Generate("r", [-1], SamplingParams()), "outside"),
    (Generate("r", [1], SamplingParams(max_tokens=-1)), "max_tokens"),
    (Generate("r", [1], SamplingParams(max_tokens=0)), "max_tokens"),  # (the limits every place checks)
    (Generate("r", [1], SamplingParams(logit_bias={100: 1.0})), "logit_bias"),
    (Generate("r", [1], SamplingParams(min_tokens=-1)), "min_tokens"),
    (Generate("r", [1], SamplingParams(temperature=math.nan)), "temperature"),
    (Generate("r", [1], SamplingParams(temperature=-0.5)), "temperature"),
    (Generate("r", [1], SamplingParams(top_p=0.0)), "top_p"),
    (Generate("r", [1], SamplingParams(top_p=math.inf)), "top_p"),
    (Generate("r", [1], SamplingParams(top_k=-1)), "top_k"),
    (Generate("r", [1], SamplingParams(top_k=2**63)), "top_k"),
    (Generate("r", [1], SamplingParams(seed=-3)), "seed"),
    (Generate("r", [1], SamplingParams(stop_token_ids=(-1,))), "stop_token_ids"),
    (Generate("r", [1], SamplingParams(stop_token_ids=tuple(range(9000)))), "stop_token_ids"),
    (Generate("r", [1], SamplingParams(), Bootstrap("", 1, 0)), "host"),
    (Generate("r", [1], SamplingParams(), Bootstrap("h", 70000, 0)), "port"),
    (Generate("r", [1], SamplingParams(), Bootstrap("h", 1, -1)), "room"),
    (Generate("r", [1, 2], SamplingParams(), None, 2), "resume_offset"),
    (Generate("r", [1, 2], SamplingParams(), None, -1), "resume_offset"),
])
def test_unacceptable_generates_say_why(g: Generate, words: str) -> None:
    why = check_generate(g, LIMITS)
    assert why is not None and words in why


OURS = KvLayout(1 << 20, 4096, 100, "DRAM")


def hello(layout: KvLayout, metadata: bytes = b"md", version: int = wire.PROTOCOL_VERSION,
          name: str = "d") -> KvHello:
    return KvHello(version, name, metadata, layout)


def test_kv_hello_bounds() -> None:
    assert check_hello(hello(KvLayout(0, 4096, MAX_PEER_PAGES, "VRAM", 3)), OURS) is None
    bad = [
        hello(KvLayout(0, 4096, 8), version=1),
        hello(KvLayout(0, 4096, 8), name="n" * 1000),
        hello(KvLayout(0, 4096, 8), metadata=b""),
        hello(KvLayout(0, 4096, 8), metadata=b"m" * (65 * 1024)),
        hello(KvLayout(0, 8192, 8)),  # other page size
        hello(KvLayout(0, 4096, MAX_PEER_PAGES + 1)),
        hello(KvLayout(0, 4096, 0)),
        hello(KvLayout(-1, 4096, 8)),
        hello(KvLayout(2**64 - 4096, 4096, 2)),
        hello(KvLayout(0, 4096, 8, "NVME")),
        hello(KvLayout(0, 4096, 8, "VRAM", 5000)),
    ]
    assert all(check_hello(h, OURS) for h in bad)


def test_kv_room_bounds() -> None:
    peer = KvLayout(0, 4096, 10)
    assert check_room(KvRoom(5, [0, 9, 3]), peer) is None
    for room, pages in [(-1, [1]), (1, []), (1, [10]), (1, [-1]), (1, [2, 2]),
                        (1, list(range(11)))]:
        assert check_room(KvRoom(room, pages), peer), (room, pages)


async def test_a_prefill_worker_announces_its_advertised_bootstrap_address(tmp_path) -> None:
    import json

    from tandem.config import WorkerConfig
    from tandem.engines.factory import make_engine
    from tests.cluster import free_port

    (tmp_path / "config.json").write_text(json.dumps(
        {"vocab_size": 100, "max_position_embeddings": 256, "eos_token_id": 2}))
    port = free_port()
    cfg = WorkerConfig(engine="mock", model=str(tmp_path), role="prefill", host="127.0.0.1",
                       bootstrap_port=port, advertise_host="10.20.30.40")
    engine = make_engine(cfg, "p")
    await engine.start()
    try:
        assert engine.bootstrap_addr == f"10.20.30.40:{port}"  # what decode workers dial
    finally:
        await engine.shutdown()
