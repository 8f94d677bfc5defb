"""Who may use the API (`--api-key-file FILE`, vLLM's `--api-key` as a file).

With a key file, every endpoint but the probes and the scrape (`/health`, `/live`, `/metrics`)
and the admin endpoint (which has a gate of its own, tandem.frontend.admin) needs one of the
file's keys, presented as `Authorization: Bearer KEY` or `api-key: KEY`. Any other request gets
OpenAI's answer to a bad key: 401, `invalid_api_key`. Without a file the API is open (vLLM's
default; a gateway in front checks keys).

The file holds one key per line; blank lines and lines starting with `#` are skipped (`keys_in`,
the one reading of the format, a client's too). Keys are kept and compared as BLAKE2b digests,
so the time a lookup takes says nothing about a key's characters. Only the operator's keys pass,
so `--tenant-by key` (the first source of its default) then reads an identity a client cannot
mint: each key is one tenant, however many requests or `user` values its holder sends.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tandem.frontend.http import Scope
from tandem.runtime import errors

OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/workers"})  # (/workers: admin.Gate)
MAX_KEY_CHARS = 4096  # a longer line in the file is refused; a longer presented key cannot match


class InvalidApiKey(errors.TandemError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


def _digest(key: bytes) -> bytes:
    return hashlib.blake2b(key, digest_size=32).digest()


def keys_in(text: str, source: str) -> list[str]:
    """The keys of a key file's `text`, in order (a client holding the file sends the first).
    ValueError naming `source` for a text that holds no key, or a key that is too long or not
    printable ASCII without spaces."""
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) > MAX_KEY_CHARS or not key.isascii() or not key.isprintable() \
                or any(c.isspace() for c in key):
            raise ValueError(f"{source}, line {n}: an API key is printable ASCII without spaces, "
                             f"at most {MAX_KEY_CHARS} characters")
        keys.append(key)
    if not keys:
        raise ValueError(f"{source} holds no API key (one per line)")
    return keys


def read_keys(path: str) -> frozenset[bytes]:
    """The digests of the keys in `path` (empty for no path). ValueError as `keys_in`; OSError if
    it cannot be read."""
    if not path:
        return frozenset()
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return frozenset(_digest(key.encode("ascii")) for key in keys_in(text, path))


def presented(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The API key a request's headers present (b"" for none): the first `Authorization: Bearer
    KEY` or `api-key: KEY`. The one reading of a client's key: the gate here, tenants (`--tenant-by
    key`) and cache partitions (`--cache-salt-by api-key`) all take it from this."""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
        if name == b"api-key" and value:
            return value.strip()
    return b""


class ApiKeys:
    def __init__(self, digests: frozenset[bytes]) -> None:
        self._digests = digests

    def refusal(self, path: str, scope: Scope) -> InvalidApiKey | None:
        """Why the request may not use `path` (None: it may)."""
        if not self._digests or path in OPEN_PATHS:
            return None
        key = presented(scope.get("headers", ()))
        if not key:
            return InvalidApiKey("You didn't provide an API key. Provide it as "
                                 "`Authorization: Bearer KEY`.")
        if len(key) > MAX_KEY_CHARS or _digest(key) not in self._digests:
            return InvalidApiKey("Incorrect API key provided.")
        return None
