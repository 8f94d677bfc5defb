"""Converters from command-line text to config values (`tandem.config` names one per field): each
returns the value or raises ValueError with a message a user can act on (`tandem.flags` shows it
as `argument --FLAG: MESSAGE`)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise ValueError(f"port {value} is out of range (1-65535)")
    return value


def port_or_zero(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"port {value} is out of range (0-65535, 0 = none)")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise ValueError(f"must be more than 0, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise ValueError(f"must be 0 or more, got {value:g}")
    return value


def model_dir(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise ValueError(f"{text!r} is not a model directory (no config.json); create a tiny one "
                         f"with `tandem model init {text}`")
    return text


def key_dir(text: str) -> str:
    """A directory holding a readable cluster key pair (checked as the flags are parsed, so a
    missing or broken key is a clear usage error, not a failure at start-up)."""
    from tandem.runtime.auth import AuthError, load_keys

    if not text:  # (none: loopback only)
        return text
    try:
        load_keys(text)
    except AuthError as e:
        raise ValueError(str(e)) from None
    return text


def _read_as_parsed(read: Callable[[str], object], text: str) -> str:
    """`text`, once `read` (a file's reader: ValueError for bad contents) has read that file."""
    try:
        read(text)
    except OSError as e:
        raise ValueError(f"cannot read {text}: {e.strerror}") from None
    return text


def admin_token_file(text: str) -> str:
    """A file holding the frontend's admin token (checked as the flags are parsed)."""
    from tandem.frontend.admin import read_token

    return _read_as_parsed(read_token, text)


def api_key_file(text: str) -> str:
    """A file of the API keys the frontend accepts (checked as the flags are parsed)."""
    from tandem.frontend.apikeys import read_keys

    return _read_as_parsed(read_keys, text)


def tenant_sources(text: str) -> tuple[str, ...]:
    from tandem.frontend.tenants import parse_sources

    return parse_sources(text)


def address_list(text: str) -> tuple[str, ...]:
    addrs = tuple(a.strip() for a in text.split(",") if a.strip())
    if not addrs:
        raise ValueError("needs at least one address, e.g. tcp://127.0.0.1:7100")
    return addrs


_GPU_ID = re.compile(r"\d+|(GPU|MIG)-[0-9A-Za-z/_-]+")


def gpu_list(text: str) -> tuple[str, ...]:
    """"0,1,2,3" -> ("0", "1", "2", "3"): GPU indexes (or NVIDIA GPU-/MIG- UUIDs, as
    CUDA_VISIBLE_DEVICES takes them), none twice."""
    ids = tuple(g.strip() for g in text.split(",") if g.strip())
    for g in ids:
        if not _GPU_ID.fullmatch(g):
            raise ValueError(f"{g!r} is not a GPU id (want e.g. 0,1,2,3)")
    twice = sorted({g for g in ids if ids.count(g) > 1})
    if twice:
        raise ValueError(f"GPU {', '.join(twice)} is listed twice")
    return ids


def salt_source(text: str) -> str:
    """`--cache-salt-by` (tandem.frontend.salt): none, user, api-key or header:NAME (the name
    lower-cased)."""
    if text in ("none", "user", "api-key"):
        return text
    name = text[len("header:"):].strip() if text.startswith("header:") else ""
    if name and all(c.isalnum() or c in "-_" for c in name):
        return "header:" + name.lower()
    raise ValueError(f"{text!r}: expected none, user, api-key or header:NAME (NAME a header "
                     "name: letters, digits, - and _)")
