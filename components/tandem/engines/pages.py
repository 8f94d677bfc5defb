"""PagePool: which KV pages are free, held by a running request, or reserved for an incoming
transfer. Plain Python, no tensors, so it is unit-testable and shared by every engine.

Invariant, checkable at any moment (`check()`): free + held + reserved == total, and no page is
counted twice. When the system is idle every page is free.
"""

from __future__ import annotations

from tandem.runtime.errors import PagePoolError

__all__ = ["PagePool", "PagePoolError", "check_accounting", "page_bytes"]


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               elem_bytes: int) -> int:
    """Bytes of one page in the page-major KV layout (all layers, K and V): the one formula every
    engine and mover uses."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * elem_bytes


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end; lowest ids first so contiguous runs are likely (one NIXL descriptor).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._held: dict[str, list[int]] = {}
        self._reserved: dict[str, list[int]] = {}

    # --- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return sum(len(p) for p in self._held.values())

    @property
    def num_reserved(self) -> int:
        return sum(len(p) for p in self._reserved.values())

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- verbs, in pairs ------------------------------------------------------------------------
    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, owner: str, num_pages: int) -> list[int]:
        """Give `owner` `num_pages` more pages (appended to what it holds); returns the new ones."""
        if num_pages > len(self._free):
            raise PagePoolError(f"need {num_pages} pages, {len(self._free)} free")
        if owner in self._reserved:
            raise PagePoolError(f"{owner} has reserved pages; commit them first")
        new = [self._free.pop() for _ in range(num_pages)]
        self._held.setdefault(owner, []).extend(new)
        return new

    def reserve(self, owner: str, num_pages: int) -> list[int]:
        """Set pages aside for a transfer into them (decode side of PD)."""
        if num_pages > len(self._free):
            raise PagePoolError(f"need {num_pages} pages, {len(self._free)} free")
        if owner in self._reserved or owner in self._held:
            raise PagePoolError(f"{owner} already has pages")
        pages = [self._free.pop() for _ in range(num_pages)]
        self._reserved[owner] = pages
        return pages

    def commit(self, owner: str) -> list[int]:
        """A transfer landed: the reserved pages become held by the running request."""
        pages = self._reserved.pop(owner)
        self._held[owner] = pages
        return pages

    def pages_of(self, owner: str) -> list[int]:
        return self._held.get(owner) or self._reserved.get(owner) or []

    def free(self, owner: str) -> int:
        """Return every page `owner` holds or reserved. Safe to call twice; returns pages freed."""
        pages = self._held.pop(owner, [])
        pages += self._reserved.pop(owner, [])
        self._free.extend(reversed(pages))
        return len(pages)

    def owners(self) -> list[str]:
        return list(self._held) + list(self._reserved)

    def check(self) -> None:
        """Raise PagePoolError if any page is lost or counted twice."""
        check_accounting(self.num_pages, self._free, [*self._held.values(),
                                                      *self._reserved.values()])


def check_accounting(num_pages: int, free: list[int], owned: list[list[int]]) -> None:
    """The invariant: the free list and every owner's pages together count each of the
    `num_pages` pages exactly once. Raises PagePoolError otherwise."""
    seen: set[int] = set(free)
    count = len(free)
    for pages in owned:
        seen.update(pages)
        count += len(pages)
    if count != num_pages or len(seen) != num_pages:
        raise PagePoolError(
            f"page accounting broken: counted {count}, distinct {len(seen)}, total {num_pages}")
