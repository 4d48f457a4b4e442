"""What an attention layer needs to know about a packed batch: where each token's K/V goes
(the slot mapping) and where each sequence's past K/V lives (its block table).

A batch packs the new tokens of every scheduled sequence back to back, with no padding:
sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``. Those rows are the last
``query_lens[i]`` positions of a context of ``context_lens[i]`` tokens, all of which are in the
paged cache once the new K/V has been stored. A decode row has one query; a plain prefill has
``query_len == context_len``; a prefill over a cached prefix (or a later prefill chunk) has
``query_len < context_len``.

The metadata of a batch is read-only once built (a frozen dataclass), and every layer of the
forward pass gets the same object. That makes it the natural home for what a backend derives
from it once per batch and reuses in every layer (``per_batch``, e.g. the batched backend's
gather plan): it lives exactly as long as the batch it describes, so it is never stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat slot = block * block_size + offset; -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [num_seqs] int32, tokens in the cache after this step's store
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of query lengths
    query_lens: list[int]  # host copies, so Python loops never sync with the device
    context_lens_list: list[int]
    # Derived once per batch by a backend, keyed by what it depends on besides the batch.
    per_batch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_list, default=0)

    @property
    def is_decode(self) -> bool:
        """True when every sequence brings exactly one new token (a pure decode round)."""
        return all(q == 1 for q in self.query_lens)

    @property
    def has_prefix(self) -> bool:
        """True when some sequence attends to cached tokens it does not bring this step."""
        return any(q != c for q, c in zip(self.query_lens, self.context_lens_list))

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Pack host-side lists into device tensors (one transfer per field)."""
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            query_lens=list(query_lens),
            context_lens_list=list(context_lens),
        )
