"""The engine's waiting sequences, in the order they are admitted (tandem.engines.scheduler):

1. the lowest `priority` first (vLLM's convention: lower is earlier; the default is 0);
2. among equal priorities, the tenant (the frontend's `Generate.tenant`) with the fewest
   sequences admitted and not finished: a tenant that sends many requests at once takes turns
   with one that sends few, instead of holding the batch until its queue drains;
3. then arrival.

While tenants share the worker (more than one sent work lately: tandem.runtime.sharing), the last
`HEADROOM` places of the batch, and the last `PAGE_HEADROOM` of the KV pool's pages, go only to a
tenant with nothing admitted (`held_back`): a client that arrives while another fills the batch
or the pool starts at the next step, instead of waiting for one of the other's requests to end. A
worker that serves one tenant (one client, or none named) keeps its whole batch and pool for it.

Each tenant's sequences wait in a heap of (priority, arrival); choosing the next looks at each
tenant's first only, so it costs the number of tenants waiting, and with one tenant (every
request of a single client, or no tenants at all) it is the heap's top.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any

from tandem.runtime.sharing import RecentTenants

HEADROOM = 1  # batch places kept for a tenant with nothing admitted, while tenants share
PAGE_HEADROOM = 1 / 16  # of the pool's pages, kept for a tenant with nothing admitted, likewise


class WaitQueue:
    """Waiting sequences (any object with `tenant` and `priority`), next first (see above)."""

    def __init__(self) -> None:
        self._heaps: dict[str, list[tuple[int, int, Any]]] = {}
        self._arrivals = itertools.count()
        self._n = 0
        self.admitted: dict[str, int] = {}  # per tenant: admitted and not finished
        self.tenants = RecentTenants()  # who sent work lately

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[Any]:
        for heap in self._heaps.values():
            for _, _, seq in heap:
                yield seq

    def append(self, seq: Any) -> None:
        self.tenants.saw(seq.tenant)
        heapq.heappush(self._heaps.setdefault(seq.tenant, []),
                       (seq.priority, next(self._arrivals), seq))
        self._n += 1

    def head(self) -> Any:
        """The sequence admitted next (the queue must not be empty)."""
        heaps = self._heaps
        if len(heaps) == 1:
            return next(iter(heaps.values()))[0][2]
        admitted = self.admitted
        tenant = min(heaps, key=lambda t: (heaps[t][0][0], admitted.get(t, 0), heaps[t][0][1]))
        return heaps[tenant][0][2]

    def held_back(self, seq: Any, places_left: int, pages_left: int | None = None,
                  num_pages: int = 0) -> bool:
        """Whether `seq` (the head) must leave the batch's last places, or the pool's last pages,
        to another tenant: `places_left`, the batch places free before it; `pages_left`, the
        pages that would be free after it took its own (None: not known yet) of `num_pages`."""
        if not self.admitted.get(seq.tenant) or (places_left > HEADROOM and (
                pages_left is None or pages_left >= num_pages * PAGE_HEADROOM)):
            return False
        return self.tenants.sharing()

    def newcomer(self, seq: Any) -> bool:
        """Whether `seq` is of a tenant with nothing admitted while tenants share the engine (it
        goes before other tenants' prompts prefilled in chunks: tandem.engines.scheduler)."""
        return not self.admitted.get(seq.tenant) and self.tenants.sharing()

    def pop(self, seq: Any) -> None:
        """`seq` (the head) is admitted: out of the queue, counted for its tenant."""
        self.remove(seq)
        self.admitted[seq.tenant] = self.admitted.get(seq.tenant, 0) + 1

    def remove(self, seq: Any) -> None:
        heap = self._heaps[seq.tenant]
        if heap[0][2] is seq:
            heapq.heappop(heap)
        else:
            heap[:] = [e for e in heap if e[2] is not seq]
            heapq.heapify(heap)
        if not heap:
            del self._heaps[seq.tenant]
        self._n -= 1

    def finished(self, seq: Any) -> None:
        """An admitted `seq` ended: its tenant has one fewer admitted."""
        n = self.admitted.get(seq.tenant, 0) - 1
        if n > 0:
            self.admitted[seq.tenant] = n
        else:
            self.admitted.pop(seq.tenant, None)
