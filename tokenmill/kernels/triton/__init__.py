"""Triton kernels (each module imports triton at load; import them lazily): kv_store, paged_attention,
rmsnorm, rotary, activation, qkv_prologue (norm + rope + store fused). Twins of each live in ``tokenmill.kernels.reference``."""
