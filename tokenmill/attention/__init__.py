"""Attention over the paged KV cache: the metadata the runner builds each step and the backends."""

from tokenmill.attention.metadata import AttentionBackend, AttentionMetadata, ForwardContext

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext"]
