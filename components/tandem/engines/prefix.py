"""Page keys of the prefix cache (tandem.engines.pages): a full page of a sequence is known by a
chained hash of (its parent page's key, its own token ids), so equal keys mean equal token
prefixes up to and including that page, and so equal K/V.

The hash is BLAKE2b (128 bits) over the parent key and the page's ids as unsigned 32-bit
integers: prompts are untrusted, and a collision would hand one request another's K/V, so the key
is a cryptographic hash wide enough that finding a collision is out of reach. A key is a
non-negative Python int below 2**128. What leaves the process in a KV event is `event_hash`, the
key's top 64 bits as a signed integer (the format's block hashes are 64-bit), an identity for
parent links and removals only: routers recompute their own keys from the token ids.

A request's cache salt (`cache_salt`: the client's, or the one its frontend derives per tenant)
gives its sequence its own root (`salt_root`): the first page's parent key is the salt's hash, so
pages of requests with different salts never share a key, and never a cached page.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

__all__ = ["ROOT", "event_hash", "page_keys", "salt_root"]

ROOT = 0  # the parent key of a sequence's first page
_KEY_BYTES = 16


def salt_root(salt: str) -> int:
    """The parent key of the first page of a sequence salted with `salt` (ROOT: no salt)."""
    if not salt:
        return ROOT
    digest = blake2b(b"tandem cache salt\0" + salt.encode(), digest_size=_KEY_BYTES).digest()
    return int.from_bytes(digest, "little")


def page_keys(tokens: Sequence[int], page_size: int, parent: int = ROOT, start: int = 0,
              end: int | None = None) -> list[int]:
    """The keys of the full pages `start, start + 1, ...` (up to `end`, or every full page) of a
    sequence whose tokens are `tokens` and whose page `start - 1` has key `parent`."""
    n_full = len(tokens) // page_size if end is None else end
    if n_full <= start:
        return []
    ids = array("I", tokens[start * page_size:n_full * page_size]).tobytes()
    step = 4 * page_size
    digest = parent.to_bytes(_KEY_BYTES, "little")
    keys: list[int] = []
    for at in range(0, len(ids), step):
        digest = blake2b(digest + ids[at:at + step], digest_size=_KEY_BYTES).digest()
        keys.append(int.from_bytes(digest, "little"))
    return keys


def event_hash(key: int) -> int:
    """A page key as a KV event's 64-bit block hash (signed, as msgpack carries it)."""
    top = key >> 64
    return top - (1 << 64) if top >= 1 << 63 else top
