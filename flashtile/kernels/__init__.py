"""Triton kernels, one module per FlashAttention version, built from shared helpers."""
