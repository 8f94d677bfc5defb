"""The reference engine: a small Llama in torch with a paged KV cache and continuous batching,
plus the tiny seeded checkpoint it runs in demos and tests. Importing it imports torch."""

from tandem.engines.reference.checkpoint import LlamaConfig, load_checkpoint, write_tiny_model
from tandem.engines.reference.engine import ReferenceEngine

__all__ = ["LlamaConfig", "ReferenceEngine", "load_checkpoint", "write_tiny_model"]
