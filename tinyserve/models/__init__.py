"""Models that run on the paged KV cache, and loading their weights."""
