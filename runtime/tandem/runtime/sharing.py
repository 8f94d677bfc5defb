"""Whether tenants share a worker: the window by which the engine's waiting queue
(tandem.engines.waiting) keeps the batch's last place and the pool's last pages, and the router
(tandem.router.accounting) a worker's last in-flight place, for a tenant with nothing there.

Tenants share while more than one has sent work within `TENANT_WINDOW_S`. One that sends one
request at a time, with gaps between, still counts as sharing through its gaps: the place kept
for it is there when its next request comes. A worker (or router) that serves one tenant (one
client, or none named) keeps every place for it.
"""

from __future__ import annotations

import time

TENANT_WINDOW_S = 30.0  # tenants share while two sent work within this long
_FORGET_PAST = 8  # tenants remembered before those not seen for a window are forgotten


class RecentTenants:
    """The tenants that sent work lately, and when each last did."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}

    def saw(self, tenant: str) -> None:
        """`tenant` sent work now."""
        now = time.monotonic()
        seen = self._seen
        if tenant not in seen and len(seen) > _FORGET_PAST:
            for t in [t for t, at in seen.items() if now - at > TENANT_WINDOW_S]:
                del seen[t]
        seen[tenant] = now

    def sharing(self) -> bool:
        """More than one tenant sent work within TENANT_WINDOW_S."""
        now = time.monotonic()
        n = 0
        for at in self._seen.values():
            if now - at <= TENANT_WINDOW_S:
                n += 1
                if n > 1:
                    return True
        return False
