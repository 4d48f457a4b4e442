"""Checkers for the chapters' exercises, one module per chapter: ``chNN.py`` holds chapter NN's.

A reader writes a function or a class in an exercise cell and passes it to a checker, which
runs it on fixed and random cases, and for the exercises whose answer is a component, inside
the real scheduler or engine, against an independent expectation, and prints a verdict. Each
checker returns True or False and is registered, with its chapter, in ``verdict.CHECKERS``:
the book's tests run every one on the chapter's solution and on deliberately wrong answers.
"""

from __future__ import annotations

from tinyserve.exercises.ch00 import check_free_blocks, check_round_phases, check_tokens_per_round
from tinyserve.exercises.ch01 import check_best_fit, check_paged_waste, check_reserved_waste, check_window_kv_bytes
from tinyserve.exercises.ch02 import check_allocator, check_num_blocks, check_slot_owner
from tinyserve.exercises.ch03 import check_conservative_manager, check_group_blocks
from tinyserve.exercises.ch04 import check_finish_rounds, check_orca_batches, check_orca_reservation
from tinyserve.exercises.ch05 import check_admission, check_cautious_swap_in, check_preempted, check_victim_policy
from tinyserve.exercises.ch06 import check_max_seqs_in_budget, check_split_x_position, check_swap_out
from tinyserve.exercises.ch07 import check_paged_attention, check_rotary_interleaved
from tinyserve.exercises.ch08 import check_decode_kernel
from tinyserve.exercises.ch09 import check_nucleus_sampler, check_worker_order
from tinyserve.exercises.ch10 import (
    check_communication,
    check_row_parallel,
    check_shard_shapes,
    check_weight_bytes_per_rank,
)
from tinyserve.exercises.ch11 import check_decode_chunks, check_kv_utilization, check_static_efficiency
from tinyserve.exercises.ch12 import check_cached_tokens, check_prefill_chunks, check_stream_text

__all__ = [
    "check_admission",
    "check_allocator",
    "check_best_fit",
    "check_cached_tokens",
    "check_cautious_swap_in",
    "check_communication",
    "check_conservative_manager",
    "check_decode_chunks",
    "check_decode_kernel",
    "check_finish_rounds",
    "check_free_blocks",
    "check_group_blocks",
    "check_kv_utilization",
    "check_max_seqs_in_budget",
    "check_nucleus_sampler",
    "check_num_blocks",
    "check_orca_batches",
    "check_orca_reservation",
    "check_paged_attention",
    "check_paged_waste",
    "check_preempted",
    "check_prefill_chunks",
    "check_reserved_waste",
    "check_rotary_interleaved",
    "check_round_phases",
    "check_row_parallel",
    "check_shard_shapes",
    "check_slot_owner",
    "check_split_x_position",
    "check_static_efficiency",
    "check_stream_text",
    "check_swap_out",
    "check_tokens_per_round",
    "check_victim_policy",
    "check_weight_bytes_per_rank",
    "check_window_kv_bytes",
    "check_worker_order",
]
