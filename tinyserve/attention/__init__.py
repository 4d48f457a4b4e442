"""Attention over a paged KV cache, and the backends that compute it.

- ``metadata``: what a layer knows about a packed batch (slot mapping, block tables, lengths).
- ``backend``: the backend protocol, the built-in backends by name, ``get_backend``.
- ``reference``: the short PyTorch version to read and test against (``"torch"``).
- ``batched``: the same math tuned for the CPU (``"torch-batched"``).
- ``triton_env``, ``triton_kernels``, ``triton_store``, ``triton_paged``: the Triton kernels
  and their launch; ``triton_backend``: the ``"triton"`` backend with its recorded fallbacks.
"""
