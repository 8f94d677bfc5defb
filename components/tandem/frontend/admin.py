"""Who may read the frontend's admin endpoint, `/workers`: it says where each worker publishes
its KV events, and the events carry the token ids of every prompt a worker caches (on a keyless
cluster anyone who can reach the address reads them; with keys they still map the cluster).

A client on loopback may read it; so may any client that presents the frontend's admin token
(`--admin-token-file FILE`: the file's first line) as `Authorization: Bearer TOKEN`. Any other
gets a 403 that says how. The probes and the scrape (`/health`, `/live`, `/metrics`) stay open.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

from tandem.frontend.http import ResponseWriter, Scope
from tandem.runtime import errors
from tandem.runtime.auth import is_loopback

PATHS = frozenset({"/workers"})


class Forbidden(errors.TandemError):
    status = 403
    type = "permission_error"
    code = "forbidden"


def read_token(path: str) -> str:
    """The admin token from its file ("" for no file); ValueError for an empty one."""
    if not path:
        return ""
    token = Path(path).read_text().strip().splitlines()
    if not token or not token[0].strip():
        raise ValueError(f"{path} holds no admin token")
    return token[0].strip()


class Gate:
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def allows(self, scope: Scope) -> bool:
        client = scope.get("client")
        if client and is_loopback(str(client[0])):
            return True
        if not self._token:
            return False
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                return hmac.compare_digest(value[7:].strip(), self._token)
        return False

    async def serve(self, path: str, scope: Scope, ex: ResponseWriter,
                    handler: Callable[[ResponseWriter], Awaitable[None]]) -> None:
        """`handler`, unless `path` is an admin endpoint this client may not read (403)."""
        if path not in PATHS or self.allows(scope):
            return await handler(ex)
        how = ("present the admin token as `Authorization: Bearer TOKEN`" if self._token else
               "start the frontend with --admin-token-file FILE and present that token")
        await ex.error(Forbidden(f"{path} is an admin endpoint: ask from loopback, or {how}."))
