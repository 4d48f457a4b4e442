"""The block-table examples of chapters 02 and 03, played on the real allocator and manager.

``seed_tables_example`` keeps tables by hand over one ``BlockAllocator`` (chapter 02, before the
BlockSpaceManager exists); ``block_manager_story`` runs allocate, fork, append_slot, swap and
free on a ``BlockSpaceManager`` and snapshots each step (chapter 03).
"""

from __future__ import annotations

from tinyserve.block import BlockAllocator, Device
from tinyserve.block_manager import BlockSpaceManager
from tinyserve.lab.block_snapshot import BlockSnapshot, snapshot
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus


def seed_tables_example():
    """Chapter 02's example: s0, s1, s2 (5, 5 and 3 prompt tokens, blocks of 4 tokens) over one
    allocator of 8 blocks. They decode one token each per step for 8 steps; s1 stops after 2
    tokens and gives its blocks back, which the others reuse, so tables end up scattered.
    Returns the allocator and the live sequences with their tables."""
    alloc = BlockAllocator(Device.GPU, block_size=4, num_blocks=8)
    seqs = {name: Sequence(i, None, list(range(100 * i, 100 * i + n)), 4)
            for i, (name, n) in enumerate([("s0", 5), ("s1", 5), ("s2", 3)])}
    tables = {name: [alloc.allocate() for _ in range(seq.n_blocks)] for name, seq in seqs.items()}
    stop_after = {"s0": 16, "s1": 2, "s2": 16}
    for step in range(8):
        for name in list(tables):
            seq = seqs[name]
            seq.append_token_id(9000 + step)
            if seq.n_blocks > len(tables[name]):
                tables[name].append(alloc.allocate())
            if seq.get_output_len() == stop_after[name]:
                for block in tables.pop(name):
                    alloc.free(block)
    return alloc, {name: (seqs[name], tables[name]) for name in tables}



def block_manager_story() -> list[BlockSnapshot]:
    """Chapter 03's story on a tiny pool (blocks of 4 tokens, 8 on the GPU, 4 on the CPU):
    allocate A (6 tokens, n=2) and B (4 tokens); fork A into two samples; append a token to each
    sequence (A.0 copies the shared block, A.1 keeps it, B takes a fresh block); swap A out and
    back in; free everything."""
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    a = Sequence(0, None, list(range(100, 106)), 4)
    b = Sequence(1, None, list(range(200, 204)), 4)
    ga = SequenceGroup("A", [a], SamplingParams(n=2, temperature=1.0), 0.0)
    gb = SequenceGroup("B", [b], SamplingParams(), 0.0)
    shots = []
    bm.allocate(ga)
    bm.allocate(gb)
    for s in (a, b):
        s.status = SequenceStatus.RUNNING
    seqs = {"A.0": a, "B": b}
    shots.append(snapshot(bm, seqs, "1. allocate(A), allocate(B): each prompt gets its blocks"))
    child = a.fork(2)
    ga.add(child)
    bm.fork(a, child)
    seqs = {"A.0": a, "A.1": child, "B": b}
    shots.append(snapshot(bm, seqs, "2. fork(A.0, A.1): the sample shares every block, ref counts 2"))
    returned = {}
    for label, seq, token in (("A.0", a, 1), ("A.1", child, 2), ("B", b, 3)):
        seq.append_token_id(token)
        returned[label] = bm.append_slot(seq)
    shots.append(snapshot(bm, seqs, "3. append_slot: A.0 copies the shared block, A.1 keeps it, B takes a new one",
                          note="returned " + ", ".join(f"{k}: {v}" for k, v in returned.items())))
    out = bm.swap_out(ga)
    for s in ga.get_seqs():
        s.status = SequenceStatus.SWAPPED
    shots.append(snapshot(bm, seqs, f"4. swap_out(A): its {len(out)} distinct blocks move to the CPU",
                          note=f"swap_out(A) returned {out}"))
    back = bm.swap_in(ga)
    for s in ga.get_seqs():
        s.status = SequenceStatus.RUNNING
    shots.append(snapshot(bm, seqs, "5. swap_in(A): back on the GPU, in whatever blocks are free",
                          note=f"swap_in(A) returned {back}"))
    for s in (a, child, b):
        bm.free(s)
    shots.append(snapshot(bm, seqs, "6. free all: every block back on the free list, ref counts 0"))
    return shots
