"""Transfer helpers that need no nixl: host-memory pre-faulting and descriptor counting. The
transfer errors (KvTransferError, KvTransferTimeout, PeerGone) live in tandem.runtime.errors."""

from __future__ import annotations

import ctypes

import numpy as np

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
