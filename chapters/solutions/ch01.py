"""Solutions to chapter 01's exercises: the size of the KV cache and what reservation wastes."""


def window_kv_bytes(seq_len, num_layers, num_kv_heads, head_dim, dtype_bytes, num_window_layers, window):
    per_token_per_layer = 2 * num_kv_heads * head_dim * dtype_bytes   # a key and a value per KV head
    full_layers = num_layers - num_window_layers
    kept = full_layers * seq_len + num_window_layers * min(seq_len, window)
    return kept * per_token_per_layer


def reserved_waste(seq_lens, max_model_len):
    return sum(max_model_len - n for n in seq_lens)


def paged_waste(seq_lens, block_size):
    # -n % b is the empty tail of the last block: 0 when n is a multiple of b, at most b - 1.
    return sum(-n % block_size for n in seq_lens)


def best_fit(runs, arena_size, length):
    best = None  # (hole length, hole start)
    pos = 0
    for start, n in sorted(runs) + [(arena_size, 0)]:
        hole = start - pos
        if hole >= length and (best is None or hole < best[0]):
            best = (hole, pos)
        pos = max(pos, start + n)
    return None if best is None else best[1]
