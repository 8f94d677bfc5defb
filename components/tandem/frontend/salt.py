"""A request's cache salt: which partition of the prefix cache it may hit (README, "Cache
isolation").

Two sources, combined: the client's own `cache_salt` (vLLM's request field: a non-empty string),
and the tenant the server partitions by (`--cache-salt-by`: `none`, `user` (the body's `user`),
`api-key` (the key the client presents, `Authorization: Bearer KEY` or `api-key: KEY`, as
tandem.frontend.apikeys reads it; checked there with `--api-key-file`, or by a gateway in front)
or `header:NAME` (that header's value)). The salt a request carries to its workers
(`Generate.cache_salt`) is a digest of both (BLAKE2b, 128 bits, hex, keyed with a key derived
from the cluster's secret: tandem.runtime.auth.digest_key, unkeyed in a keyless cluster): a
tenant's value is never sent, published or logged in clear, and the digest its KV events carry
cannot be tested against a guessed value without the cluster's secret. "" (no salt: the shared
partition) when neither applies. A request of a partitioned server that lacks the tenant's value
(no `user`, no key, no header) is in the partition of the empty value: the anonymous tenant's.

The salt roots the request's page keys in the engines (tandem.engines.prefix.salt_root) and its
block keys in the router (tandem.router.blocks.salt_root), and its first page's KV event carries
it: requests with different salts never share a cached page, and the router never predicts one.
"""

from __future__ import annotations

from hashlib import blake2b

from tandem.converters import salt_source
from tandem.frontend.apikeys import presented
from tandem.runtime.errors import BadRequest

__all__ = ["MAX_CLIENT_SALT_CHARS", "Salter", "check_client_salt", "salt_source"]

MAX_CLIENT_SALT_CHARS = 1024


class Salter:
    """The salt of each request, by the server's `--cache-salt-by`."""

    def __init__(self, by: str = "none", key: bytes = b"") -> None:
        self.by = salt_source(by)
        self.key = key  # (tandem.runtime.auth.digest_key)
        self._header = self.by[len("header:"):].encode() if self.by.startswith("header:") else b""

    def tenant(self, headers: list[tuple[bytes, bytes]], user: str) -> bytes | None:
        """The request's tenant value (None: the server does not partition)."""
        if self.by == "none":
            return None
        if self.by == "user":
            return user.encode("utf-8", "surrogatepass")
        if self.by == "api-key":
            return presented(headers)
        for name, value in headers:
            if name == self._header:
                return value
        return b""

    def __call__(self, headers: list[tuple[bytes, bytes]], user: str,
                 client_salt: str | None) -> str:
        tenant = self.tenant(headers, user)
        if tenant is None and client_salt is None:
            return ""
        h = blake2b(b"tandem cache partition\0", digest_size=16, key=self.key)
        if tenant is not None:
            h.update(b"tenant\0" + self.by.encode() + b"\0" + len(tenant).to_bytes(8, "little")
                     + tenant)
        if client_salt is not None:
            h.update(b"client\0" + client_salt.encode("utf-8", "surrogatepass"))
        return h.hexdigest()


def check_client_salt(salt: object) -> str | None:
    """The body's `cache_salt`, checked (400 naming it if it is not a non-empty string of at most
    MAX_CLIENT_SALT_CHARS characters)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CLIENT_SALT_CHARS:
        raise BadRequest(f"cache_salt must be a non-empty string of at most "
                         f"{MAX_CLIENT_SALT_CHARS} characters.", param="cache_salt")
    return salt
