"""What a worker checks in a `Generate` before its engine sees it (ARCHITECTURE.md, "Worker").

A frontend validates what clients send; a worker still meets bytes from any peer that reached its
socket, so it refuses, with one reason in words, what would hurt an engine or the process: an empty
prompt, token ids outside the model's vocabulary, sampling parameters outside the limits every
place checks (tandem.runtime.sampling: NaN temperature, negative max_tokens or top_k, integers past
64 bits, huge stop lists, ...), a malformed request id or bootstrap address, an over-long tenant or
a priority past 64 bits. Every check is
O(prompt length) or less, done in C where it scans the prompt; a set of sampling parameters found
valid is not checked again (the engine's own check of it is then a look-up).

`check_generate` is pure: the server turns a reason into an error delta (ErrorKind.BAD_REQUEST).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.runtime.sampling import INT_MAX, check_sampling
from tandem.runtime.wire import Bootstrap, Generate

MAX_RID_CHARS = 256
MAX_HOST_CHARS = 255
MAX_TENANT_CHARS = 64  # (the frontend sends a 32-character hash)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the worker's engine can take (0 = unknown: that check is skipped)."""

    vocab_size: int = 0
    max_context: int = 0


MAX_SALT_CHARS = 256  # (a KV event carries it: tandem.runtime.kv_events caps names so)


def check_generate(g: Generate, limits: Limits) -> str | None:
    """None if `g` may go to the engine, else why not."""
    if not g.rid or len(g.rid) > MAX_RID_CHARS:
        return f"request id must have 1 to {MAX_RID_CHARS} characters"
    why = check_prompt(g.prompt_ids, limits)
    if why is None and not 0 <= g.resume_offset < len(g.prompt_ids):
        why = "resume_offset must be at least 0 and less than the prompt's length"
    if why is None and len(g.cache_salt) > MAX_SALT_CHARS:
        why = f"cache_salt must have at most {MAX_SALT_CHARS} characters"
    if why is None:
        problem = check_sampling(g.sampling, limits.vocab_size)
        why = problem[0] if problem is not None else None
    if why is None and g.bootstrap is not None:
        why = check_bootstrap(g.bootstrap)
    if why is None and len(g.tenant) > MAX_TENANT_CHARS:
        why = f"tenant has more than {MAX_TENANT_CHARS} characters"
    if why is None and not -INT_MAX - 1 <= g.priority <= INT_MAX:
        why = "priority must fit in 64 bits"
    return why


def check_prompt(ids: list[int], limits: Limits) -> str | None:
    if not ids:
        return "prompt is empty"
    if limits.max_context and len(ids) > limits.max_context:
        return f"prompt has {len(ids)} tokens; this model's context is {limits.max_context}"
    lo, hi = min(ids), max(ids)
    top = limits.vocab_size or INT_MAX + 1
    if lo < 0 or hi >= top:
        return f"prompt has token ids outside [0, {top})"
    return None


MAX_PREFILLS = 4096  # prefill workers one frontend may announce


def check_prefills(addresses: list[str]) -> str | None:
    """A frontend's `Prefills`: a bounded list of host:port strings."""
    if len(addresses) > MAX_PREFILLS:
        return f"more than {MAX_PREFILLS} prefill workers announced"
    for a in addresses:
        host, _, port = a.rpartition(":")
        if not host or len(host) > MAX_HOST_CHARS or not port.isdigit() or len(port) > 5:
            return "a prefill address is not host:port"
    return None


def check_bootstrap(b: Bootstrap) -> str | None:
    if not b.host or len(b.host) > MAX_HOST_CHARS:
        return "bootstrap host is empty or too long"
    if not 0 < b.port < 65536:
        return "bootstrap port must be in [1, 65535]"
    if b.room < 0:
        return "bootstrap room must not be negative"
    return None
