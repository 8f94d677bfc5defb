"""tandem.runtime — engine-independent plumbing: wire protocol, ZMQ transport, config, lifecycle,
errors and metrics. Never imports torch, sglang or nixl."""
