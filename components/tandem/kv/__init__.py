"""KV cache bookkeeping (page pool) and, later, the NIXL handoff between prefill and decode."""
