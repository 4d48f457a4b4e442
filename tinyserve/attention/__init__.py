"""Attention over a paged KV cache: the PyTorch reference and the Triton kernels."""
