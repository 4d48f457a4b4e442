"""Requests as the scheduler sees them.

A request becomes a ``SequenceGroup``: one prompt and the sequences sampled from it (several
when ``n > 1``). Each ``Sequence`` keeps its tokens and cuts them into *logical* blocks of
``block_size`` tokens; the BlockSpaceManager maps those to *physical* blocks in the cache.
"""

from __future__ import annotations

import enum
import numbers
import reprlib
from dataclasses import dataclass, field

from tinyserve.sampling_params import SamplingParams


def check_token_ids(name: str, ids, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, or a ValueError naming ``name`` if it is not a list of token ids."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                     for t in ids):
        raise ValueError(f"{name} must be a list of integer token ids, got {reprlib.repr(ids)}")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{name} must be in [0, {vocab_size}), the model's vocabulary")
    return [int(t) for t in ids]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort", "ignored"), None while unfinished."""
        return self.value if self.is_finished else None


class LogicalTokenBlock:
    """A block's worth of a sequence's tokens, before we know where they live in memory."""

    def __init__(self, block_number: int, block_size: int) -> None:
        self.block_number = block_number
        self.block_size = block_size
        self.token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def is_full(self) -> bool:
        return len(self.token_ids) == self.block_size

    def __repr__(self) -> str:
        return f"LogicalTokenBlock({self.block_number}, {self.token_ids})"


class Sequence:
    """One stream of tokens: the prompt followed by what has been generated so far."""

    def __init__(self, seq_id: int, prompt: str | None, prompt_token_ids: list[int], block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.seq_id = seq_id
        self.prompt = prompt
        self.block_size = block_size
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_text = ""
        # The model's log-probability of each output token, summed (best_of ranks samples by it),
        # and, when the request asks for logprobs, one {token_id: logprob} dict per output token.
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        # Incremental detokenization (see detokenizer.py): output tokens before read_offset are
        # in output_text; those from prefix_offset to read_offset are decoded again as context.
        self.prefix_offset = 0
        self.read_offset = 0
        self.status = SequenceStatus.WAITING
        self.finish_message: str | None = None
        # Tokens whose K/V is already in the cache. A prefill (or a prefill chunk, or a cached
        # prefix) advances it; recompute-preemption resets it to 0.
        self.num_computed_tokens = 0
        self.logical_token_blocks: list[LogicalTokenBlock] = []
        self._append_to_blocks(self.prompt_token_ids)

    def _append_to_blocks(self, token_ids: list[int]) -> None:
        for t in token_ids:
            if not self.logical_token_blocks or self.logical_token_blocks[-1].is_full():
                self.logical_token_blocks.append(LogicalTokenBlock(len(self.logical_token_blocks), self.block_size))
            self.logical_token_blocks[-1].token_ids.append(t)

    def append_token_id(self, token_id: int, logprob: float = 0.0,
                        top_logprobs: dict[int, float] | None = None) -> None:
        """Append a sampled token; ``logprob`` is its log-probability, ``top_logprobs`` the dict
        kept when the request asks for logprobs."""
        self.output_token_ids.append(token_id)
        self._append_to_blocks([token_id])
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def n_blocks(self) -> int:
        return len(self.logical_token_blocks)

    def is_finished(self) -> bool:
        return self.status.is_finished

    def is_prefill(self) -> bool:
        """True while some of its tokens (other than the last, newly sampled one) lack K/V."""
        # Only a sampled token may lack K/V in a decode: a prompt chunk that stops one token
        # short of the prompt's end still leaves a prefill to finish.
        return self.num_computed_tokens < self.get_len() - (1 if self.output_token_ids else 0)

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def fork(self, new_seq_id: int) -> Sequence:
        child = Sequence(new_seq_id, self.prompt, self.prompt_token_ids, self.block_size)
        for t in self.output_token_ids:
            child.append_token_id(t)
        child.output_text = self.output_text
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.prefix_offset, child.read_offset = self.prefix_offset, self.read_offset
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        return child

    def __repr__(self) -> str:
        return f"Sequence(seq_id={self.seq_id}, status={self.status.name}, len={self.get_len()})"


class SequenceGroup:
    """A request: the sequences that share one prompt and one set of SamplingParams."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float) -> None:
        if not seqs:
            raise ValueError("a SequenceGroup needs at least one sequence")
        self.request_id = request_id
        self.seqs_dict = {s.seq_id: s for s in seqs}
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        # Set when the group was ignored (prompt too long, can never fit): tells the user why.
        self.error: str | None = None
        # Set with error when the engine gave up for lack of memory now (a retry may succeed).
        self.retryable = False
        # With SamplingParams.prompt_logprobs: None for the first prompt token, then one
        # {token_id: logprob} dict per prompt token, filled as the prefill computes them.
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def prompt(self) -> str | None:
        return next(iter(self.seqs_dict.values())).prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).prompt_token_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [s for s in self.seqs_dict.values() if s.status == status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs_dict.values() if not s.is_finished()]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def get_max_num_running_seqs(self) -> int:
        """Sequences this group will run at once: best_of (n unless set) after its prompt is
        sampled, else the live ones."""
        if self.is_waiting_for_prefill():
            return self.sampling_params.num_samples
        return len(self.get_unfinished_seqs())

    def is_waiting_for_prefill(self) -> bool:
        seqs = self.get_unfinished_seqs()
        return len(seqs) == 1 and seqs[0].get_output_len() == 0

    def find(self, seq_id: int) -> Sequence:
        return self.seqs_dict[seq_id]

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs_dict:
            raise ValueError(f"sequence {seq.seq_id} is already in group {self.request_id}")
        self.seqs_dict[seq.seq_id] = seq

    def remove(self, seq_id: int) -> None:
        """Take a sequence out of the group (a beam that dropped out: beam search, chapter 14)."""
        if seq_id not in self.seqs_dict:
            raise ValueError(f"sequence {seq_id} is not in group {self.request_id}")
        del self.seqs_dict[seq_id]

    def is_finished(self) -> bool:
        return all(s.is_finished() for s in self.seqs_dict.values())

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={len(self.seqs_dict)})"


@dataclass
class SequenceGroupMetadata:
    """What the worker needs to run one scheduled group this round.

    ``token_chunk_size`` is how many new tokens each sequence brings: the uncomputed part of
    the prompt (or one chunk of it) in a prefill, 1 in a decode.
    """

    request_id: str
    is_prompt: bool
    seq_data: dict[int, Sequence]
    sampling_params: SamplingParams
    block_tables: dict[int, list[int]]
    token_chunk_size: int = 1
    do_sample: bool = True  # False for a prefill chunk that does not reach the prompt's end
    computed_block_nums: list[int] = field(default_factory=list)
