"""Checkers for chapter 09, the worker and the engine, one module per exercise; this one holds the
input builder's and re-exports the others, so that every checker is ``tinyserve.exercises.ch09``'s.

- ``check_input_builder``: the reader's ``prepare_inputs(groups, block_size, device)``, on random
  rounds (prefills, prefill chunks after a computed prefix, recomputed prompts, decodes, groups
  of several samples, block tables in any order) against the package's ``model_runner.prepare_inputs``,
  field by field, naming the field and the sequence where they differ; then the tiny model in the
  real engine through ``Worker(prepare_inputs=...)``, greedy s0/s1/s2, whole prompts and chunked.
- ``check_sampler`` (``ch09_sampler``): the reader's ``Sampler`` class against the package's.
- ``check_worker_order`` (``ch09_order``): one round of the worker's cache orders on toy caches.
- ``check_engine_step`` (``ch09_step``): the reader's serving loop, step by step against the
  package's engine.
"""


from __future__ import annotations

import random
from collections.abc import Callable

import torch

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.exercises.engine_runs import PROMPTS, Run, same_tokens, tiny
from tinyserve.exercises.verdict import checker, verdict
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceGroupMetadata
from tinyserve.worker import Worker

# -- the input builder --------------------------------------------------------------------------


def _random_round(rng: random.Random, block_size: int) -> list[SequenceGroupMetadata]:
    """One round as a scheduler could hand it out: prefills (some after a computed prefix, as
    prefix caching leaves them), prefill chunks that stop short of the prompt's end (not sampled),
    recomputed prompts that carry their outputs, decodes, and groups of 2-3 samples that share
    their prompt's blocks. Block numbers are drawn at random, so no table is in order."""
    groups, seq_ids = [], iter(range(1000))
    free = rng.sample(range(4 * 64), 4 * 64)  # block numbers, in no order
    for g in range(rng.randint(1, 6)):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(1, 3 * block_size + 2))]
        kind = rng.choice(["prefill", "prefix", "chunk", "recompute", "decode", "decode", "samples"])
        params = SamplingParams(temperature=0.0)
        outputs = [rng.randrange(1, 500) for _ in range(rng.randint(1, 2 * block_size))]
        if kind not in ("recompute", "decode", "samples"):
            outputs = []
        # n > 1: the samples share the prompt and all but the last output token
        num_seqs = rng.randint(2, 3) if kind == "samples" else 1
        if num_seqs > 1:
            params = SamplingParams(n=num_seqs, temperature=1.0)
        seqs = []
        for _ in range(num_seqs):
            seqs.append(Sequence(next(seq_ids), None, prompt, block_size))
            for t in outputs[:-1] + ([rng.randrange(1, 500)] if outputs else []):
                seqs[-1].append_token_id(t)
        seq = seqs[0]
        if kind in ("decode", "samples"):
            start, chunk = seq.get_len() - 1, 1
        elif kind == "recompute":
            start, chunk = 0, seq.get_len()
        elif kind == "prefix":
            start = rng.randrange(len(prompt))
            chunk = len(prompt) - start
        elif kind == "chunk":
            start = rng.randrange(len(prompt))
            chunk = rng.randint(1, len(prompt) - start)
        else:
            start, chunk = 0, len(prompt)
        tables = {}
        # Samples share their prompt's full blocks (copy-on-write left the rest to each).
        shared = [free.pop() for _ in range(len(prompt) // block_size)] if num_seqs > 1 else []
        for s in seqs:
            s.num_computed_tokens = start
            need = -(-s.get_len() // block_size)
            # A table may hold a block more than the round needs (allocated ahead), never fewer.
            tables[s.seq_id] = shared + [free.pop() for _ in range(need - len(shared) + rng.randint(0, 1))]
        end = start + chunk
        groups.append(SequenceGroupMetadata(f"r{g}", kind not in ("decode", "samples"), {s.seq_id: s for s in seqs},
                                            params, tables, token_chunk_size=chunk,
                                            do_sample=end == seq.get_len()))
    return groups


def _describe_round(groups: list[SequenceGroupMetadata], block_size: int) -> str:
    parts = []
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            start = seq.num_computed_tokens
            kind = "prefill" if meta.is_prompt else "decode"
            parts.append(f"{meta.request_id}/seq {seq_id} {kind} positions {start}..{start + meta.token_chunk_size - 1}"
                         f" of {seq.get_len()}, table {meta.block_tables[seq_id]}"
                         + ("" if meta.do_sample else ", not sampled"))
    return f"block_size {block_size}: " + "; ".join(parts)


def _row_owners(groups: list[SequenceGroupMetadata]) -> tuple[list[str], list[str]]:
    """Who each packed row is ("r0/seq 1 position 7") and who each sequence index is."""
    rows, seqs = [], []
    for meta in groups:
        for seq_id, seq in meta.seq_data.items():
            seqs.append(f"{meta.request_id}/seq {seq_id}")
            start = seq.num_computed_tokens
            rows += [f"{meta.request_id}/seq {seq_id} position {p}"
                     for p in range(start, start + meta.token_chunk_size)]
    return rows, seqs


# The fields compared, in the order the reader builds them: (name, getter, what its index is).
_FIELDS: list[tuple[str, Callable, str]] = [
    ("input_ids", lambda m: m.input_ids, "row"),
    ("positions", lambda m: m.positions, "row"),
    ("attn_metadata.slot_mapping", lambda m: m.attn_metadata.slot_mapping, "row"),
    ("attn_metadata.query_lens", lambda m: m.attn_metadata.query_lens, "seq"),
    ("attn_metadata.context_lens_list", lambda m: m.attn_metadata.context_lens_list, "seq"),
    ("attn_metadata.context_lens", lambda m: m.attn_metadata.context_lens, "seq"),
    ("attn_metadata.query_start_loc", lambda m: m.attn_metadata.query_start_loc, "start"),
    ("attn_metadata.block_tables", lambda m: m.attn_metadata.block_tables, "seq"),
    ("sample_indices", lambda m: m.sample_indices, "sample"),
    ("sample_seqs", lambda m: [(meta.request_id, seq.seq_id) for meta, seq in m.sample_seqs], "sample"),
    ("logit_indices", lambda m: m.logit_indices, "none"),
]


def _as_list(value):
    return value.tolist() if isinstance(value, torch.Tensor) else value


def input_difference(got, want, groups: list[SequenceGroupMetadata]) -> str | None:
    """The first field where ``got`` differs from ``want`` (both ModelInputs), with the sequence
    (and position) it belongs to, or None."""
    rows, seqs = _row_owners(groups)
    samples = [f"{meta.request_id}/seq {seq_id}" for meta in groups if meta.do_sample for seq_id in meta.seq_data]
    for name, get, index in _FIELDS:
        try:
            mine = get(got)
        except Exception as e:
            return f"{name}: cannot be read ({type(e).__name__}: {e})"
        expected = get(want)
        if isinstance(expected, torch.Tensor):
            if not isinstance(mine, torch.Tensor):
                return f"{name} is a {type(mine).__name__}, expected a torch tensor of {expected.dtype}"
            if mine.dtype != expected.dtype:
                return f"{name} is {mine.dtype}, expected {expected.dtype}"
            if mine.device != expected.device:
                return f"{name} is on {mine.device}, expected on {expected.device} (the device argument)"
        mine, expected = _as_list(mine), _as_list(expected)
        if mine == expected:
            continue
        if expected is None or mine is None:
            return f"{name} is {mine!r}, expected {expected!r}"
        if len(mine) != len(expected):
            return f"{name} has {len(mine)} entries, expected {len(expected)}: {mine} instead of {expected}"
        i = next(i for i, (a, b) in enumerate(zip(mine, expected)) if a != b)
        if index == "row":
            who = f" (row {i}: {rows[i]})"
        elif index == "seq":
            who = f" (sequence {i}: {seqs[i]})"
        elif index == "start":
            who = f" (entry {i}: where {seqs[i]} starts)" if i < len(seqs) else f" (entry {i}: the batch's end)"
        elif index == "sample":
            who = f" (sampled row {i}: {samples[i] if i < len(samples) else '?'})"
        else:
            who = ""
        return f"{name}[{i}] is {mine[i]}, expected {expected[i]}{who}"
    return None


def _run_with_inputs(label: str, fn, *, chunked: bool) -> Run:
    """s0/s1/s2 greedily on the tiny model, the Worker packing with ``fn``; ``chunked``: with a
    6-token budget and chunked prefill, so that prompts arrive in pieces beside decodes."""
    loaded = tiny()
    model_config = ModelConfig(model="in-memory")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    try:
        worker = Worker(model_config, attention_backend="torch", loaded=loaded, prepare_inputs=fn)
        engine = LLMEngine(model_config, CacheConfig(block_size=4, num_gpu_blocks=64, num_cpu_blocks=8, watermark=0.0),
                           SchedulerConfig(max_num_batched_tokens=6 if chunked else 64,
                                           max_num_seqs=3 if chunked else 8, max_model_len=64,
                                           enable_chunked_prefill=chunked),
                           executor=worker)
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
    except Exception as e:  # the reader's code: report, do not stop the chapter
        return Run(label, {}, error=f"{type(e).__name__}: {e}")
    return Run(label, {rid: done[rid] for rid in PROMPTS})


@checker(chapter=9, answer="prepare_inputs")
def check_input_builder(fn: Callable, num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(groups, block_size, device)`` packs a round's ``SequenceGroupMetadata`` into one
    ``ModelInput``, as ``model_runner.prepare_inputs`` does (the rounds have no ``prompt_logprobs``,
    so ``logit_indices`` stays None). Random rounds are compared field by field with the package's;
    then, if all agree, s0/s1/s2 run greedily on the tiny model in the engine with ``fn`` as the
    Worker's ``prepare_inputs`` (whole prompts, then chunked prefill): the tokens must be the
    package's."""
    rng = random.Random(seed)
    failures = []
    for _ in range(num_cases):
        block_size = rng.choice([1, 2, 4, 5, 16])
        groups = _random_round(rng, block_size)
        want = prepare_inputs(groups, block_size, "cpu")
        before = [(s.num_computed_tokens, s.get_token_ids()) for m in groups for s in m.seq_data.values()]
        try:
            got = fn(groups, block_size, torch.device("cpu"))
            difference = input_difference(got, want, groups)
        except Exception as e:  # the reader's code: any error is a failed case
            difference = f"raised {type(e).__name__}: {e}"
        if difference is None and before != [(s.num_computed_tokens, s.get_token_ids())
                                              for m in groups for s in m.seq_data.values()]:
            difference = "changed the sequences (num_computed_tokens or tokens): packing only reads them"
        if difference:
            failures.append(f"{_describe_round(groups, block_size)}: {difference}")
    if not failures:
        for chunked in (False, True):
            package = _run_with_inputs("package's prepare_inputs", prepare_inputs, chunked=chunked)
            yours = _run_with_inputs("your prepare_inputs", fn, chunked=chunked)
            if not same_tokens(yours, package):
                failures.append(f"in the engine{' with chunked prefill' if chunked else ''}: "
                                f"{yours.error or f'tokens {yours.tokens}, expected {package.tokens}'}")
    return verdict("input_builder", failures, num_cases + 2)


# The other exercises' checkers, re-exported: the chapter imports them all from here.
from tinyserve.exercises.ch09_order import check_worker_order, worker_order_reference  # noqa: E402, F401
from tinyserve.exercises.ch09_sampler import check_sampler  # noqa: E402, F401
from tinyserve.exercises.ch09_step import check_engine_step  # noqa: E402, F401
