"""Run the real Scheduler with no model: output lengths are scripted, tokens are fake.

This is how the book steps through scheduling rounds on a laptop in milliseconds. Each round
is recorded as a ``RoundRecord``; the engine records its real rounds in the same form, so the
same drawings and widgets show both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tinyserve.block import Device
from tinyserve.config import CacheConfig, SchedulerConfig
from tinyserve.scheduler import Scheduler, SchedulerOutputs
from tinyserve.sequence import SamplingParams, Sequence, SequenceGroup


@dataclass
class Request:
    """A scripted request: a prompt of ``prompt_len`` tokens that will produce ``output_len``
    tokens (its prefill produces the first), arriving before round ``arrival_round`` is scheduled.

    The prompt's tokens are made up and unlike any other request's, unless ``prompt_token_ids``
    gives them: requests that share a prefix (a system prompt) can then share cached blocks.
    """

    request_id: str
    prompt_len: int
    output_len: int
    arrival_round: int = 1
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival_round < 1:
            raise ValueError(f"request {self.request_id!r}: prompt_len, output_len and arrival_round must be >= 1")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids has {len(self.prompt_token_ids)} "
                             f"tokens but prompt_len is {self.prompt_len}")


@dataclass
class RoundRecord:
    """One scheduling round, as it happened. Queue contents are taken after scheduling."""

    round: int
    phase: str  # "prefill" | "decode" | "mixed" | "idle"
    batch: list[str]
    preempted: list[str]
    swapped_out: list[str]
    swapped_in: list[str]
    finished: list[str]
    ignored: list[str]
    waiting: list[str]
    running: list[str]
    swapped: list[str]
    free_gpu_blocks: int
    block_tables: dict[str, list[int]]  # GPU block tables of running groups
    cpu_block_tables: dict[str, list[int]] = field(default_factory=dict)  # swapped groups
    free_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    num_cpu_blocks: int = 0
    num_batched_tokens: int = 0
    chunk_sizes: dict[str, int] = field(default_factory=dict)  # new tokens each batch member brought
    tokens: dict[str, str] = field(default_factory=dict)  # what each batch member produced (engine: text)
    prefills: list[str] | None = None  # batch members that prefilled (None: a record made by hand)

    @property
    def batch_size(self) -> int:
        return len(self.batch)


def seq_key(group: SequenceGroup, seq: Sequence) -> str:
    """A request id, suffixed with the sample index when a request has several sequences."""
    seqs = group.get_seqs()
    return group.request_id if len(seqs) == 1 else f"{group.request_id}.{seqs.index(seq)}"


def make_record(round_no: int, scheduler: Scheduler, out: SchedulerOutputs, finished: list[str],
                tokens: dict[str, str] | None = None) -> RoundRecord:
    """Snapshot the scheduler after a round (shared by the simulator and the engine)."""
    bm = scheduler.block_manager
    gpu_tables: dict[str, list[int]] = {}
    cpu_tables: dict[str, list[int]] = {}
    for group in list(scheduler.running) + list(scheduler.swapped):
        for seq in group.get_unfinished_seqs():
            if seq.seq_id in bm.block_tables:
                target = gpu_tables if bm.get_block_device(seq) == Device.GPU else cpu_tables
                target[seq_key(group, seq)] = bm.get_block_table(seq)
    batch = out.request_ids
    return RoundRecord(
        round=round_no,
        phase=out.phase,
        batch=batch,
        preempted=list(out.preempted),
        swapped_out=list(out.swapped_out),
        swapped_in=list(out.swapped_in),
        finished=list(finished),
        ignored=[g.request_id for g in out.ignored_seq_groups],
        waiting=[g.request_id for g in scheduler.waiting],
        running=[g.request_id for g in scheduler.running],
        swapped=[g.request_id for g in scheduler.swapped],
        free_gpu_blocks=bm.get_num_free_gpu_blocks(),
        block_tables=gpu_tables,
        cpu_block_tables=cpu_tables,
        free_cpu_blocks=bm.get_num_free_cpu_blocks(),
        num_gpu_blocks=bm.num_total_gpu_blocks,
        num_cpu_blocks=bm.num_total_cpu_blocks,
        num_batched_tokens=out.num_batched_tokens,
        chunk_sizes={s.seq_group.request_id: s.token_chunk_size for s in out.scheduled_seq_groups},
        tokens=dict(tokens or {}),
        prefills=[s.seq_group.request_id for s in out.scheduled_seq_groups if s.is_prompt],
    )


def simulate(requests: list[Request], scheduler_config: SchedulerConfig, cache_config: CacheConfig,
             max_rounds: int = 10_000, *, scheduler: Scheduler | None = None) -> list[RoundRecord]:
    """Drive the scheduler round by round until every request has finished or been ignored.

    ``scheduler`` runs a Scheduler built beforehand (say with a reader's ``block_manager``,
    ``choose_victim`` or ``can_admit``) instead of one built from the two configs; it must be
    empty, with the same block size. Raises RuntimeError if no progress is possible (a hang
    is a bug, never an answer).
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"request ids must be unique, got {ids}")
    if scheduler is None:
        scheduler = Scheduler(scheduler_config, cache_config)
    elif scheduler.has_unfinished_seqs() or scheduler.cache_config.block_size != cache_config.block_size:
        raise ValueError("scheduler must be an empty Scheduler built with the same cache_config block_size")
    pending = sorted(requests, key=lambda r: r.arrival_round)
    seq_ids = itertools.count()
    fake_token = itertools.count(1000)
    records: list[RoundRecord] = []
    for round_no in range(1, max_rounds + 1):
        while pending and pending[0].arrival_round <= round_no:
            r = pending.pop(0)
            # Distinct fake token ids per request, so no two prompts look alike (unless given).
            if r.prompt_token_ids is not None:
                prompt = list(r.prompt_token_ids)
            else:
                prompt = [next(fake_token) for _ in range(r.prompt_len)]
            seq = Sequence(next(seq_ids), None, prompt, cache_config.block_size)
            scheduler.add_seq_group(SequenceGroup(r.request_id, [seq], SamplingParams(max_tokens=r.output_len),
                                                  arrival_time=float(round_no)))
        if not pending and not scheduler.has_unfinished_seqs():
            break
        _, out = scheduler.schedule()
        # Each sequence that reaches its end gets a made-up token; output_len is its max_tokens.
        finished = scheduler.postprocess(out, lambda group, seq: next(fake_token))
        records.append(make_record(round_no, scheduler, out, finished))
        if out.phase == "idle" and not (out.ignored_seq_groups or out.preempted or pending):
            raise RuntimeError(f"no progress in round {round_no}: waiting={[g.request_id for g in scheduler.waiting]}, "
                               f"swapped={[g.request_id for g in scheduler.swapped]}")
    else:
        raise RuntimeError(f"simulation did not finish within {max_rounds} rounds")
    return records


def format_rounds(records: list[RoundRecord]) -> str:
    """A plain-text table of rounds, as the book and the closing notes print it."""
    lines = [f"{'round':>5}  {'phase':<7}  {'batch':<22} {'preempted':<10} {'waiting':<12} {'running':<14} "
             f"{'swapped':<10} {'finished':<10} free"]
    for r in records:
        lines.append(f"{r.round:>5}  {r.phase:<7}  {','.join(r.batch) or '-':<22} {','.join(r.preempted) or '-':<10} "
                     f"{','.join(r.waiting) or '-':<12} {','.join(r.running) or '-':<14} "
                     f"{','.join(r.swapped) or '-':<10} {','.join(r.finished) or '-':<10} {r.free_gpu_blocks}")
    return "\n".join(lines)
