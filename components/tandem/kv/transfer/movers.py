"""Movers: what carries a request's KV pages from the prefill engine's memory into the decode
engine's. The bootstrap protocol (tandem.kv.bootstrap.decode) decides which pages go where; a mover only
moves them, within a deadline.

- `NixlMover` WRITEs real pages with NIXL (tandem.kv.transfer.nixl; DRAM on CPU, VRAM on CUDA);
- `LocalMover` copies pages between two KV tensors of one process (tests, no NIXL needed);
- `SimulatedMover` moves nothing and only costs time (the mock engine's transfer model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.runtime.errors import KvTransferError, KvTransferTimeout
from tandem.runtime.wire import KvLayout


class KvMover(Protocol):
    """One worker's end of the KV transfer: who it is (metadata, layout, sent once per peer), the
    peers it writes to, and page writes with a deadline (raising a KvTransferError)."""

    def metadata(self) -> bytes: ...
    def kv_layout(self) -> KvLayout: ...
    def add_peer(self, metadata: bytes, layout: KvLayout) -> str: ...
    def remove_peer(self, peer: str) -> None: ...
    async def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    deadline_s: float) -> None: ...
    def close(self) -> None: ...


def _check_peer(ours: KvLayout, theirs: KvLayout) -> None:
    if theirs.page_bytes != ours.page_bytes:
        raise ValueError(f"peer pages are {theirs.page_bytes} bytes, ours {ours.page_bytes}")


class _InProcessMover:
    """What a mover without NIXL announces and accepts: its name as its metadata, a layout of
    its own memory kind, any peer whose pages are as large as ours."""

    def __init__(self, name: str, page_bytes: int, num_pages: int, mem: str) -> None:
        self.name = name
        self._layout = KvLayout(0, page_bytes, num_pages, mem)

    def metadata(self) -> bytes:
        return self.name.encode()

    def kv_layout(self) -> KvLayout:
        return self._layout

    def add_peer(self, metadata: bytes, layout: KvLayout) -> str:
        _check_peer(self._layout, layout)
        return metadata.decode()

    def remove_peer(self, peer: str) -> None:
        pass

    def close(self) -> None:
        pass


class SimulatedMover(_InProcessMover):
    """Moves no bytes; a write takes num_pages * page_bytes / bytes_per_s (0 = instant)."""

    def __init__(self, name: str, page_bytes: int, num_pages: int, bytes_per_s: float = 0.0):
        super().__init__(name, page_bytes, num_pages, "SIM")
        self.bytes_per_s = bytes_per_s

    async def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    deadline_s: float) -> None:
        if self.bytes_per_s > 0:
            cost = len(local) * self._layout.page_bytes / self.bytes_per_s
            if cost > deadline_s:
                await asyncio.sleep(deadline_s)
                raise KvTransferTimeout(f"KV transfer to {peer} passed its {deadline_s:.1f}s "
                                        "deadline")
            await asyncio.sleep(cost)


class LocalFabric:
    """The KV tensors of the engines in one process, by mover name: what LocalMovers write into."""

    def __init__(self) -> None:
        self.kv: dict[str, Any] = {}


class LocalMover(_InProcessMover):
    """Copies page-major KV pages between tensors of one process (`dst[remote] = src[local]`)."""

    def __init__(self, fabric: LocalFabric, name: str, kv: Any, page_bytes: int,
                 num_pages: int) -> None:
        super().__init__(name, page_bytes, num_pages, "LOCAL")
        self.fabric, self._kv = fabric, kv
        fabric.kv[name] = kv

    async def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    deadline_s: float) -> None:
        dst = self.fabric.kv.get(peer)
        if dst is None:
            raise KvTransferError(f"peer {peer} is gone")
        dst[list(remote)] = self._kv[list(local)]

    def close(self) -> None:
        if self.fabric.kv.get(self.name) is self._kv:
            del self.fabric.kv[self.name]


class NixlMover:
    """One NIXL agent over a worker's page-major KV tensor; a write's deadline is its own."""

    def __init__(self, name: str, kv: Any, page_bytes: int, num_pages: int) -> None:
        from tandem.kv.transfer import nixl as nx

        is_cuda = getattr(getattr(kv, "device", None), "type", "cpu") == "cuda"
        mem: nx.MemType = "VRAM" if is_cuda else "DRAM"
        device = (kv.device.index or 0) if is_cuda else 0
        self.agent = nx.KvAgent(name, kv, page_bytes, num_pages, mem, device)

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def kv_layout(self) -> KvLayout:
        return self.agent.layout()

    def add_peer(self, metadata: bytes, layout: KvLayout) -> str:
        return self.agent.add_peer(metadata, layout)

    def remove_peer(self, peer: str) -> None:
        self.agent.remove_peer(peer)

    async def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    deadline_s: float) -> None:
        await self.agent.write_pages(peer, local, remote, deadline_s)

    def close(self) -> None:
        self.agent.close()
