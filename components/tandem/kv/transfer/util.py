"""Transfer helpers that need no nixl: a KV tensor's region and its per-page descriptor table,
host-memory pre-faulting and descriptor counting. The transfer errors (KvTransferError,
KvTransferTimeout, PeerGone) live in tandem.runtime.errors."""

from __future__ import annotations

import ctypes
from typing import Any, Literal

import numpy as np

from tandem.runtime.wire import KvLayout

MemType = Literal["DRAM", "VRAM"]

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without changing them


def prefault_host_memory(addr: int, nbytes: int, hugepages: bool = True) -> bool:
    """Best effort: advise transparent huge pages, then fault every page in, writable, without
    changing its bytes, so the first write into it pays no page faults. False if unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = addr & ~4095
    length = ctypes.c_size_t(addr + nbytes - start)
    if hugepages:
        libc.madvise(ctypes.c_void_p(start), length, _MADV_HUGEPAGE)
    return bool(libc.madvise(ctypes.c_void_p(start), length, _MADV_POPULATE_WRITE) == 0)


def count_descriptors(local_pages: np.ndarray, remote_pages: np.ndarray) -> int:
    """Descriptors after merging: one per run of pages consecutive on both sides."""
    if len(local_pages) == 0:
        return 0
    return int(((np.diff(local_pages) != 1) | (np.diff(remote_pages) != 1)).sum()) + 1


def page_descs(layout: KvLayout) -> np.ndarray:
    """One (address, bytes, device) row per page of a page-major region."""
    descs = np.empty((layout.num_pages, 3), dtype=np.uint64)
    offsets = np.arange(layout.num_pages, dtype=np.uint64) * np.uint64(layout.page_bytes)
    descs[:, 0] = np.uint64(layout.base_addr) + offsets
    descs[:, 1] = layout.page_bytes
    descs[:, 2] = layout.device
    return descs


def region_of(kv: Any, mem: MemType, device: int) -> tuple[int, int]:
    """(address, nbytes) of a contiguous page-major KV tensor on the given memory."""
    if not kv.is_contiguous():
        raise ValueError("the KV tensor must be contiguous (page-major)")
    is_cuda = kv.device.type == "cuda"
    if is_cuda != (mem == "VRAM") or (is_cuda and kv.device.index != device):
        raise ValueError(f"KV tensor on {kv.device} does not match mem={mem} device={device}")
    return int(kv.data_ptr()), int(kv.numel() * kv.element_size())
