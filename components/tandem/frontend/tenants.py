"""Who sent a request (its tenant): what fairness across clients is kept by, in the frontend's
admission queue (tandem.router.admission) and in the workers (the engine's waiting queue and
grammar compiles, tandem.engines.waiting and tandem.engines.grammars).

`--tenant-by` lists where the identity is read, first found wins:
- `key`: the API key the client presents (`Authorization: Bearer KEY`, or `api-key: KEY`); one
  the client cannot mint when the frontend checks keys (`--api-key-file`, tandem.frontend.apikeys);
- `user`: the body's `user` field;
- `header:NAME`: a header of the operator's choice (e.g. one a gateway sets);
- `address`: the client's IP address.
With none found, the request belongs to the anonymous tenant ("": every such request together).

What travels to the workers (`Generate.tenant`) is a 128-bit BLAKE2b digest of the source and
the value, in hex, keyed with a key derived from the cluster's secret
(tandem.runtime.auth.digest_key; unkeyed in a keyless cluster): a worker, its logs and its metrics
never see an API key, and nobody without the cluster's secret can test a guessed value against
a digest.
"""

from __future__ import annotations

import hashlib

from tandem.frontend.apikeys import presented
from tandem.frontend.http import Scope

SOURCES = ("key", "user", "address")  # and header:NAME
DEFAULT = ("key", "user", "address")
MAX_VALUE_CHARS = 1024  # (a longer identity is cut: it is only hashed)


def parse_sources(text: str) -> tuple[str, ...]:
    """`key,user,header:x-tenant` -> its sources (ValueError naming a bad one)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part in SOURCES:
            out.append(part)
        elif part.startswith("header:") and len(part) > len("header:"):
            out.append("header:" + part[len("header:"):].lower())
        else:
            raise ValueError(f"{part!r} is not a tenant source: use key, user, address or "
                             "header:NAME, comma-separated, first found wins")
    if not out:
        raise ValueError("needs at least one source: key, user, address or header:NAME")
    return tuple(out)


def tenant_of(scope: Scope, user: str, sources: tuple[str, ...], key: bytes = b"") -> str:
    """The request's tenant: the digest of the first identity `sources` find ("" for none),
    keyed with `key` (tandem.runtime.auth.digest_key)."""
    for source in sources:
        value = _value(scope, user, source)
        if value:
            raw = f"{source}\0{value[:MAX_VALUE_CHARS]}".encode("utf-8", "surrogateescape")
            return hashlib.blake2b(raw, digest_size=16, key=key).hexdigest()
    return ""


def _value(scope: Scope, user: str, source: str) -> str:
    if source == "user":
        return user
    if source == "address":
        client = scope.get("client")
        return str(client[0]) if client else ""
    if source == "key":
        return presented(scope.get("headers", ())).decode("latin-1")
    wanted = source[len("header:"):].encode("latin-1")
    for name, value in scope.get("headers", ()):
        if name == wanted and value:
            return value.decode("latin-1")
    return ""
