"""Building blocks of the decoders: tensor-parallel linears and embeddings, RMSNorm, RoPE,
SiluAndMul, and the paged attention layer."""
