"""Chapter 03's BlockSpaceManager, driven one operation at a time from a short script.

A script is a list of lines, each one operation on a real ``BlockSpaceManager``:

=====================  ==================================================================
``allocate A``         admit request A: ``can_allocate``, then ``allocate`` its prompt
``fork A.0 A.1``       a new sample A.1 of A.0 that shares all its blocks (``fork``)
``append A.0``         A.0 samples a token; ``append_slot`` makes room for its K/V
``swap_out A``         move A's blocks to CPU swap space (``swap_out``)
``swap_in A``          bring them back (``swap_in``)
``free A.0``           A.0 is done: ``free`` drops its share of each block
=====================  ==================================================================

``play_block_script`` runs the lines in order and calls ``observe(manager, seqs, op)`` after
each, while the objects are in the state that operation left; chapter 03's widget takes a
snapshot there. An operation the manager refuses (no room) is reported, not raised, since
that is something to see; a line that makes no sense raises ValueError naming the line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinyserve.block_manager import AllocStatus, BlockSpaceManager
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

# The chapter's story: two requests, a fork, the three cases of append_slot, a swap round trip.
BLOCK_STORY = ("allocate A", "allocate B", "fork A.0 A.1", "append A.0", "append A.1", "append B",
               "swap_out A", "swap_in A", "free A.0", "free A.1", "free B")
STORY_REQUESTS = {"A": (6, 2), "B": (4, 1)}  # request id -> (prompt tokens, samples n)

Observer = Callable[[BlockSpaceManager, dict[str, Sequence], "BlockOp"], None]


@dataclass
class BlockOp:
    """One line of a script, once it has run."""

    line: str      # the script line
    call: str      # the manager call it made, as code
    result: str    # what the call returned (or why it was refused)
    meaning: str   # what happened, in a sentence
    done: bool = True  # False when the manager refused (no room); nothing changed then


class _Script:
    """The live objects of one script run: the manager, the groups and the labelled sequences."""

    def __init__(self, requests: dict[str, tuple[int, int]], manager: BlockSpaceManager) -> None:
        self.bm = manager
        self.groups: dict[str, SequenceGroup] = {}
        self.seqs: dict[str, Sequence] = {}   # label -> sequence, in the order they appeared
        self.next_seq_id = 0
        self.next_token = 1
        for k, (rid, (prompt_len, n)) in enumerate(requests.items()):
            if prompt_len < 1 or n < 1:
                raise ValueError(f"requests[{rid!r}]: prompt length and n must be >= 1, got {(prompt_len, n)}")
            seq = Sequence(self._seq_id(), None, list(range(100 * (k + 1), 100 * (k + 1) + prompt_len)),
                           manager.block_size)
            self.groups[rid] = SequenceGroup(rid, [seq], SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0),
                                             arrival_time=float(k))
        self.first_label = {rid: (f"{rid}.0" if g.sampling_params.n > 1 else rid) for rid, g in self.groups.items()}

    def _seq_id(self) -> int:
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def group(self, rid: str) -> SequenceGroup:
        if rid not in self.groups:
            raise ValueError(f"no request {rid!r} (requests: {', '.join(self.groups)})")
        return self.groups[rid]

    def seq(self, label: str) -> Sequence:
        if label not in self.seqs:
            raise ValueError(f"no sequence {label!r} yet (sequences: {', '.join(self.seqs) or 'none'})")
        return self.seqs[label]

    def group_of(self, label: str) -> SequenceGroup:
        return self.group(label.split(".")[0])

    def table(self, label: str) -> str:
        seq = self.seqs[label]
        if seq.seq_id not in self.bm.block_tables:
            return "no blocks"
        device = self.bm.get_block_device(seq)
        return f"{device.name} {self.bm.get_block_table(seq)}"

    # -- the operations ------------------------------------------------------------------------

    def allocate(self, rid: str) -> BlockOp:
        group = self.group(rid)
        label = self.first_label[rid]
        if label in self.seqs:
            raise ValueError(f"request {rid!r} is already allocated")
        status = self.bm.can_allocate(group)
        if status != AllocStatus.OK:
            return BlockOp("", f"bm.can_allocate({rid})", f"AllocStatus.{status.name}",
                           f"{rid} is not admitted: its prompt does not fit now ({status.name})", done=False)
        self.bm.allocate(group)
        seq = group.get_seqs()[0]
        seq.status = SequenceStatus.RUNNING  # the scheduler does this when it admits a group
        self.seqs[label] = seq
        return BlockOp("", f"bm.allocate({rid})", "None",
                       f"can_allocate said OK; {label}'s prompt of {seq.get_len()} tokens gets {self.table(label)}")

    def fork(self, parent_label: str, child_label: str) -> BlockOp:
        parent = self.seq(parent_label)
        if child_label in self.seqs:
            raise ValueError(f"sequence {child_label!r} exists already")
        if child_label.split(".")[0] != parent_label.split(".")[0]:
            raise ValueError(f"a fork stays in its request: {child_label!r} is not a sample of {parent_label!r}'s")
        if self.bm.get_block_device(parent) is None or parent.status != SequenceStatus.RUNNING:
            raise ValueError(f"{parent_label} has no running blocks to share")
        child = parent.fork(self._seq_id())
        self.group_of(parent_label).add(child)
        self.bm.fork(parent, child)
        self.seqs[child_label] = child
        return BlockOp("", f"bm.fork({parent_label}, {child_label})", "None",
                       f"{child_label} shares all of {parent_label}'s blocks: {self.table(child_label)}, "
                       "one more owner each")

    def append(self, label: str) -> BlockOp:
        seq = self.seq(label)
        if seq.status != SequenceStatus.RUNNING:
            raise ValueError(f"{label} is not running on the GPU ({seq.status.name})")
        group = self.group_of(label)
        if not self.bm.can_append_slot(group):
            return BlockOp("", f"bm.can_append_slot({group.request_id})", "False",
                           f"no free GPU block for {label}'s next token: the scheduler would preempt someone",
                           done=False)
        before = self.bm.get_block_table(seq)
        seq.append_token_id(self.next_token)
        self.next_token += 1
        cow = self.bm.append_slot(seq)
        after = self.bm.get_block_table(seq)
        if cow is not None:
            meaning = (f"copy-on-write: block {cow[0]} is shared, so {label} takes block {cow[1]} and the worker "
                       f"copies {cow[0]} into {cow[1]} before writing")
        elif len(after) > len(before):
            meaning = f"token {seq.get_len()} starts logical block {len(after) - 1}: a fresh block {after[-1]}"
        else:
            meaning = f"token {seq.get_len()} goes in place, into block {after[-1]}, which is {label}'s alone"
        return BlockOp("", f"bm.append_slot({label})", repr(cow), meaning)

    def swap_out(self, rid: str) -> BlockOp:
        return self._swap(rid, out=True)

    def swap_in(self, rid: str) -> BlockOp:
        return self._swap(rid, out=False)

    def _swap(self, rid: str, out: bool) -> BlockOp:
        group = self.group(rid)
        name = "swap_out" if out else "swap_in"
        src, dst = ((SequenceStatus.RUNNING, SequenceStatus.SWAPPED) if out
                    else (SequenceStatus.SWAPPED, SequenceStatus.RUNNING))
        if not group.get_seqs(src):
            raise ValueError(f"request {rid!r} has nothing {'running on the GPU' if out else 'swapped out'}")
        if not (self.bm.can_swap_out if out else self.bm.can_swap_in)(group):
            room = "free CPU blocks to take" if out else "free GPU blocks to bring back (and let grow)"
            return BlockOp("", f"bm.can_{name}({rid})", "False", f"not enough {room} {rid}", done=False)
        mapping = (self.bm.swap_out if out else self.bm.swap_in)(group)
        for seq in group.get_seqs(src):
            seq.status = dst
        meaning = (f"{len(mapping)} distinct blocks of {rid} move GPU -> CPU as {{gpu: cpu}}" if out else
                   f"{rid}'s blocks come back CPU -> GPU as {{cpu: gpu}}, into whatever blocks are free")
        return BlockOp("", f"bm.{name}({rid})", repr(mapping), meaning)

    def free(self, label: str) -> BlockOp:
        seq = self.seq(label)
        if seq.is_finished():
            raise ValueError(f"{label} is freed already")
        had = self.table(label)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED_STOPPED
        return BlockOp("", f"bm.free({label})", "None",
                       f"{label} drops its share of {had}; a block goes back to the free list when no one holds it")


_ARITY = {"allocate": 1, "fork": 2, "append": 1, "swap_out": 1, "swap_in": 1, "free": 1}


def play_block_script(script: list[str] | tuple[str, ...] = BLOCK_STORY, observe: Observer | None = None,
                      requests: dict[str, tuple[int, int]] | None = None, block_size: int = 4,
                      num_gpu_blocks: int = 8, num_cpu_blocks: int = 4, watermark: float = 0.0) -> list[BlockOp]:
    """Run ``script`` on a fresh BlockSpaceManager; return one BlockOp per line.

    ``requests`` maps a request id to (prompt tokens, samples n); by default the chapter's A (6
    tokens, n=2) and B (4 tokens). A request's first sequence is labelled ``A.0`` when it will
    have several samples, else ``A``."""
    run = _Script(dict(STORY_REQUESTS if requests is None else requests),
                  BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark=watermark))
    ops = []
    for n, line in enumerate(script, start=1):
        words = line.split()
        if not words or words[0] not in _ARITY or len(words) != _ARITY[words[0]] + 1:
            raise ValueError(f"script line {n} {line!r}: expected one of "
                             "'allocate R', 'fork S T', 'append S', 'swap_out R', 'swap_in R', 'free S'")
        try:
            op = getattr(run, words[0])(*words[1:])
        except ValueError as e:
            raise ValueError(f"script line {n} {line!r}: {e}") from None
        op.line = line
        ops.append(op)
        if observe is not None:
            # Samples of one request side by side (A.0, A.1, B), whatever order they appeared in.
            observe(run.bm, dict(sorted(run.seqs.items())), op)
    return ops
