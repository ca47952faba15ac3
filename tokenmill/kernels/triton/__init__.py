"""Triton kernels (each module imports triton at load; import them lazily): kv_store, paged_attention,
rmsnorm, rotary, activation, qkv_prologue (norm + rope + store fused), fused_moe and moe_align
(mixture-of-experts GEMMs), and the rest named in docs/architecture.md. Twins of each live in ``tokenmill.kernels.reference``."""
