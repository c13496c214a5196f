"""Pallas kernels: fused flash attention and block-sparse layers (importable without zeroflow)."""
