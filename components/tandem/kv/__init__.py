"""KV between workers: the bootstrap protocol (bootstrap/) and the byte movers (transfer/). Page
accounting is the engines' (tandem.engines.pages)."""
