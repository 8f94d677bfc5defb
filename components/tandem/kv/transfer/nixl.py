"""KV page transfer over NIXL (imported through `nixl_api`, the one module that imports nixl).

Owns a worker's NIXL agent (UCX backend, no NIXL progress thread), the registration of the
worker's page-major KV region, prepared descriptor lists with one descriptor per page (ours, and
each peer's, prepared once), and page WRITEs from our pages into a peer's pages with a deadline.

Contracts:
- Page i is the contiguous range [base + i*page_bytes, +page_bytes). A write names pages by index;
  NIXL merges consecutive indices that are contiguous on both sides into one descriptor, so a run
  of pages costs one descriptor, not one per page.
- `write_pages` returns once every byte is in the peer's pages, or raises `KvTransferTimeout`,
  `PeerGone` or `KvTransferError` (tandem.runtime.errors). Every handle is released on every path
  by the code that made it, also when the awaiting task is cancelled; a handle is never posted
  twice. Over CMA the copy runs inside `transfer()`: small writes run it on the caller's thread
  (cheaper than a thread hop), larger ones in `num_streams` threads, each bound to its own UCX
  worker, in parallel.
- A target must make progress for the first write from each peer stream to complete (connection
  wireup): the agent's own thread does that every `progress_interval_s` (~2% of a core at 5 ms);
  an agent made without it calls `progress()` itself.
- `import tandem.kv.transfer.nixl` works without nixl; a `KvAgent` then raises `KvTransferError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.kv.transfer import nixl_api
from tandem.kv.transfer.util import (MemType, count_descriptors, page_descs, prefault_host_memory,
                                     region_of)
from tandem.runtime.errors import KvTransferError, KvTransferTimeout, PeerGone
from tandem.runtime.wire import KvLayout

log = logging.getLogger(__name__)

__all__ = ["KvAgent", "MemType", "WriteResult"]

_INSTALL_HINT = "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 (see README.md)"


@dataclass(frozen=True, slots=True)
class WriteResult:
    num_pages: int
    num_bytes: int
    num_descriptors: int  # after merging runs contiguous on both sides
    seconds: float


@dataclass(slots=True)
class _Peer:
    name: str
    layout: KvLayout
    dlist: Any  # prepared remote descriptor list; None once released
    num_inflight: int = 0
    removed: bool = False


class KvAgent:
    """One NIXL agent per worker, owning the registration of its KV pages (`kv`: a contiguous
    page-major tensor, kept alive as long as the agent).

    Writes of at most `inline_max_bytes` run on the caller's thread; larger ones are split over
    up to `num_streams` threads, each stream carrying at least `min_stream_bytes`. `close()`
    waits for running writes, which their deadlines bound. For VRAM, create the CUDA context
    (allocate the tensor) before the agent.
    """

    def __init__(self, name: str, kv: Any, page_bytes: int, num_pages: int,
                 mem: MemType = "DRAM", device: int = 0, *, num_streams: int = 2,
                 min_stream_bytes: int = 8 << 20, inline_max_bytes: int = 2 << 20,
                 progress_interval_s: float | None = 0.005, prefault: bool = True) -> None:
        if page_bytes <= 0 or num_pages <= 0 or num_streams <= 0:
            raise ValueError("page_bytes, num_pages and num_streams must be positive")
        if mem not in ("DRAM", "VRAM"):
            raise ValueError(f"mem must be DRAM or VRAM, not {mem!r}")
        addr, nbytes = region_of(kv, mem, device)
        if nbytes < page_bytes * num_pages:
            raise ValueError(f"KV region has {nbytes} bytes, pages need {page_bytes * num_pages}")
        try:
            api, _bindings = nixl_api.load()
        except ImportError as e:
            raise KvTransferError(f"nixl is not installed: {_INSTALL_HINT}") from e
        self._gone_error: type[BaseException] = _bindings.nixlRemoteDisconnectError
        names = [n for n in dir(_bindings) if n.startswith("nixl") and n.endswith("Error")]
        self._nixl_errors: tuple[type[BaseException], ...] = tuple(getattr(_bindings, n)
                                                                   for n in names)
        self._kv = kv  # keeps the registered memory alive
        self._layout = KvLayout(addr, page_bytes, num_pages, mem, device)
        self._num_streams = num_streams
        self._min_stream_bytes = min_stream_bytes
        self._inline_max_bytes = inline_max_bytes
        if prefault and mem == "DRAM":
            prefault_host_memory(addr, page_bytes * num_pages)
        # RW sync: NIXL is called from several threads at once; UCX workers become thread-safe.
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._agent = api.nixl_agent(name, config)
        self._agent.create_backend("UCX", {"num_workers": str(num_streams)})
        self._reg = self._agent.register_memory([(addr, page_bytes * num_pages, device, "")], mem)
        self._dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", page_descs(self._layout), mem)
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._num_open = 0  # handles made and not yet released
        self._stuck: list[Any] = []  # handles whose release failed: retried, never posted again
        self._progress_lock = threading.Lock()
        self._closed = False
        self._pool = ThreadPoolExecutor(num_streams, thread_name_prefix=f"kv-xfer-{name}")
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None
        if progress_interval_s is not None:
            self._progress = threading.Thread(target=self._progress_loop,
                                              args=(progress_interval_s,),
                                              name=f"kv-progress-{name}", daemon=True)
            self._progress.start()

    # --- identity and peers ---------------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self._agent.name)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def layout(self) -> KvLayout:
        return self._layout

    @property
    def peers(self) -> list[str]:
        with self._lock:
            return [p.name for p in self._peers.values() if not p.removed]

    @property
    def num_open_transfers(self) -> int:
        """Transfer handles not yet released: 0 whenever no write is running."""
        with self._lock:
            return self._num_open + len(self._stuck)

    def add_peer(self, metadata: bytes, layout: KvLayout) -> str:
        """Load a peer's agent metadata, prepare its page descriptors; returns its name."""
        self._check_open()
        if layout.page_bytes != self._layout.page_bytes:
            ours = self._layout.page_bytes
            raise ValueError(f"peer pages are {layout.page_bytes} bytes, ours {ours}")
        with self._lock:
            loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            old = self._peers.get(name)
            if old is not None and not old.removed:
                if old.layout != layout:
                    raise ValueError(f"peer {name} was added with another layout")
                return name
            dlist = self._agent.prep_xfer_dlist(name, page_descs(layout), layout.mem)
            self._peers[name] = _Peer(name, layout, dlist)
            return name

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (e.g. after PeerGone); released once its running writes end. Idempotent."""
        with self._lock:
            p = self._peers.get(peer)
            if p is not None and not p.removed:
                p.removed = True
                if p.num_inflight == 0:
                    self._drop_peer_locked(p)

    # --- writes (initiator side) ----------------------------------------------------------------
    async def write_pages(self, peer: str, local_pages: Sequence[int],
                          remote_pages: Sequence[int], deadline_s: float = 10.0) -> WriteResult:
        """WRITE our `local_pages[i]` into the peer's `remote_pages[i]`. `deadline_s`: seconds
        allowed from this call until every byte is in place (checked between NIXL calls: a copy
        running inside `transfer()` is not cut short)."""
        deadline = time.monotonic() + deadline_s
        t0 = time.perf_counter()
        local = np.asarray(local_pages, dtype=np.int64)
        remote = np.asarray(remote_pages, dtype=np.int64)
        num_bytes = len(local) * self._layout.page_bytes
        k = max(1, min(self._num_streams, num_bytes // self._min_stream_bytes, len(local)))
        if num_bytes <= self._inline_max_bytes:
            k = 0
        p = self._begin(peer, local, remote, max(k, 1))
        if k > 0:
            await self._write_streams(p, local, remote, k, deadline)
        else:  # small: copy on this thread, cheaper than a thread hop
            handle, done = self._start(p, local.astype(np.int32), remote.astype(np.int32))
            if done:
                self._finish(p, handle, True, deadline)
            else:  # a pool thread waits for it, and owns the handle from now on
                try:
                    fut = self._submit(p, 0, self._finish, p, handle, False, deadline)
                except KvTransferError:
                    self._release(handle)
                    raise
                await fut
        return WriteResult(len(local), num_bytes, count_descriptors(local, remote),
                           time.perf_counter() - t0)

    def _submit(self, p: _Peer, num_after: int, fn: Any, *args: Any) -> asyncio.Future[None]:
        try:
            return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except RuntimeError as e:  # pool shut down by close(): end this chunk and the ones after
            for _ in range(num_after + 1):
                self._end(p)
            raise KvTransferError("kv agent is closed") from e

    async def _write_streams(self, p: _Peer, local: np.ndarray, remote: np.ndarray, k: int,
                             deadline: float) -> None:
        bounds = [len(local) * j // k for j in range(k + 1)]
        futs = [
            self._submit(p, k - 1 - j, self._write_chunk, p, local[a:b].astype(np.int32),
                         remote[a:b].astype(np.int32), deadline)
            for j, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
        results = await asyncio.gather(*futs, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise next((e for e in errors if isinstance(e, PeerGone)), errors[0])

    def _write_chunk(self, p: _Peer, local: np.ndarray, remote: np.ndarray,
                     deadline: float) -> None:
        # In a pool thread: NIXL binds a UCX worker to the thread that makes the handle.
        handle, done = self._start(p, local, remote)
        self._finish(p, handle, done, deadline)

    def _start(self, p: _Peer, local: np.ndarray, remote: np.ndarray) -> tuple[Any, bool]:
        """Make and post a handle; True if the copy is complete already."""
        self._release_stuck()
        try:
            handle = self._agent.make_prepped_xfer("WRITE", self._dlist, local, p.dlist, remote)
        except BaseException as e:
            self._end(p)
            if isinstance(e, self._nixl_errors):
                raise self._map_error(p.name, e) from e
            raise
        with self._lock:
            self._num_open += 1
        try:
            return handle, self._state(handle, p.name, None)  # over CMA the copy is in here
        except BaseException:
            self._release(handle)
            self._end(p)
            raise

    def _finish(self, p: _Peer, handle: Any, done: bool, deadline: float) -> None:
        """Wait for the copy until the deadline, release the handle, end the chunk."""
        try:
            try:
                pause = 20e-6
                while not done:
                    time.sleep(pause)
                    pause = min(pause * 2, 1e-3)
                    done = self._state(handle, p.name, deadline)
            finally:
                self._release(handle)
        finally:
            self._end(p)

    def _state(self, handle: Any, peer: str, deadline: float | None) -> bool:
        """Post the handle (deadline None) or check it; True when done."""
        if deadline is not None and time.monotonic() >= deadline:
            raise KvTransferTimeout(f"write to {peer} passed its deadline")
        try:
            if deadline is None:
                state = self._agent.transfer(handle)
            else:
                state = self._agent.check_xfer_state(handle)
        except self._nixl_errors as e:
            raise self._map_error(peer, e) from e
        if state not in ("DONE", "PROC"):
            raise KvTransferError(f"write to {peer} failed ({state})")
        return bool(state == "DONE")

    def _map_error(self, peer: str, e: BaseException) -> KvTransferError:
        if isinstance(e, self._gone_error):
            return PeerGone(f"peer {peer} disconnected: {e}")
        return KvTransferError(f"transfer to {peer} failed: {type(e).__name__}: {e}")

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
            stuck = False
        except self._nixl_errors as e:  # not cancellable yet: keep it, retry, never post it again
            log.warning("kv transfer handle release failed (%s); will retry", e)
            stuck = True
        with self._lock:
            self._num_open -= 1
            if stuck:
                self._stuck.append(handle)

    def _release_stuck(self) -> None:
        with self._lock:
            stuck, self._stuck = self._stuck, []
        for handle in stuck:
            try:
                handle.release()
            except self._nixl_errors:
                with self._lock:
                    self._stuck.append(handle)

    # --- progress (target side) ------------------------------------------------------------------
    def progress(self) -> None:
        """Make UCX progress once (wireup, acks), so that writes into this agent complete; the
        agent's own thread does this unless it was made with `progress_interval_s=None`."""
        if self._closed:
            return
        with self._progress_lock:
            self._agent.get_new_notifs()

    def _progress_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.progress()
            except Exception:
                log.exception("nixl progress failed")

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for running writes (bounded by their deadlines), release everything. Safe twice."""
        if self._closed:
            return
        self._closed = True  # (no new write starts: _check_open)
        self._stop.set()
        if self._progress is not None:
            self._progress.join()
        self._pool.shutdown(wait=True)
        self._release_stuck()
        with self._lock:
            for p in list(self._peers.values()):
                self._drop_peer_locked(p)
        try:
            self._dlist.release()
            self._agent.deregister_memory(self._reg)
        except self._nixl_errors as e:
            log.warning("closing kv agent %s: %s", self.name, e)

    def _check_open(self) -> None:
        if self._closed:
            raise KvTransferError("kv agent is closed")
    def _begin(self, peer: str, local: np.ndarray, remote: np.ndarray, num_chunks: int) -> _Peer:
        self._check_open()
        if len(local) != len(remote) or len(local) == 0:
            raise ValueError(f"need equal, non-empty page lists ({len(local)} vs {len(remote)})")
        with self._lock:
            p = self._peers.get(peer)
            if p is None or p.removed:
                raise KvTransferError(f"unknown peer {peer!r}")
            if local.min() < 0 or local.max() >= self._layout.num_pages:
                raise ValueError(f"local page out of range [0, {self._layout.num_pages})")
            if remote.min() < 0 or remote.max() >= p.layout.num_pages:
                raise ValueError(f"remote page out of range [0, {p.layout.num_pages})")
            p.num_inflight += num_chunks  # each chunk ends itself, wherever it runs
            return p

    def _end(self, p: _Peer) -> None:
        with self._lock:
            p.num_inflight -= 1
            if p.removed and p.num_inflight == 0:
                self._drop_peer_locked(p)

    def _drop_peer_locked(self, p: _Peer) -> None:
        if p.dlist is None:
            return
        current = self._peers.get(p.name) is p  # not re-added under the same name meanwhile
        try:
            p.dlist.release()
            if current:
                self._agent.remove_remote_agent(p.name)
        except self._nixl_errors as e:
            log.warning("removing kv peer %s: %s", p.name, e)
        p.dlist = None
        if current:
            del self._peers[p.name]
