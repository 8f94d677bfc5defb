"""Movers: what carries a room's KV pages from the prefill worker to the decode worker.

`NixlMover` WRITEs real pages with NIXL (tandem.kv.nixl_transfer, DRAM on CPU, VRAM on CUDA);
`SimulatedMover` moves nothing and only costs time (the mock engine's transfer model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tandem.kv.handoff import KvHandoffError
from tandem.kv.transfer_util import KvTransferError
from tandem.runtime.wire import KvLayout


class SimulatedMover:
    """Moves no bytes; a write takes num_pages * page_bytes / bytes_per_s (0 = instant)."""

    def __init__(self, name: str, page_bytes: int, num_pages: int, bytes_per_s: float = 0.0):
        self.name = name
        self._layout = KvLayout(0, page_bytes, num_pages, "SIM")
        self.bytes_per_s = bytes_per_s

    def metadata(self) -> bytes:
        return self.name.encode()

    def kv_layout(self) -> KvLayout:
        return self._layout

    def add_peer(self, metadata: bytes, layout: KvLayout) -> str:
        if layout.page_bytes != self._layout.page_bytes:
            raise ValueError(f"peer pages are {layout.page_bytes} bytes, ours {self._layout.page_bytes}")
        return metadata.decode()

    def remove_peer(self, peer: str) -> None:
        pass

    async def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    deadline_s: float) -> None:
        if self.bytes_per_s > 0:
            cost = len(local) * self._layout.page_bytes / self.bytes_per_s
            if cost > deadline_s:
                await asyncio.sleep(deadline_s)
                raise KvHandoffError(f"KV transfer to {peer} passed its {deadline_s:.1f}s deadline")
            await asyncio.sleep(cost)

    def close(self) -> None:
        pass


class NixlMover:
    """One NIXL agent over a worker's page-major KV tensor; a write's deadline is its own."""

    def __init__(self, name: str, kv: Any, page_bytes: int, num_pages: int) -> None:
        from tandem.kv import nixl_transfer as nx

        is_cuda = getattr(getattr(kv, "device", None), "type", "cpu") == "cuda"
        mem = "VRAM" if is_cuda else "DRAM"
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
        try:
            await self.agent.write_pages(peer, local, remote, b"", deadline_s)
        except KvTransferError as e:
            raise KvHandoffError(str(e)) from e

    def close(self) -> None:
        self.agent.close()
