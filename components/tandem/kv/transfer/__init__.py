"""Moving KV bytes between workers: NIXL (nixl.py, the only module that imports nixl), the movers the
handoff calls (movers.py), and which network interface UCX may use (net.py)."""
