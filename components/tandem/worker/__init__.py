"""Worker process: serves one engine to frontends over a ZMQ ROUTER socket."""
