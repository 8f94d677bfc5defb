"""Engines behind one contract (base.Engine): reference (torch Llama), mock (timing), sglang."""
