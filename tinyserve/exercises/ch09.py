"""Checkers for chapter 09, the worker and the engine.

- ``check_input_builder``: the reader's ``prepare_inputs(groups, block_size, device)``, on random
  rounds (prefills, prefill chunks after a computed prefix, recomputed prompts, decodes, groups
  of several samples, block tables in any order) against the package's ``model_runner.prepare_inputs``,
  field by field, naming the field and the sequence where they differ; then the tiny model in the
  real engine through ``Worker(prepare_inputs=...)``, greedy s0/s1/s2, whole prompts and chunked.
- ``check_sampler``: the reader's ``Sampler`` class, ``Sampler(seed)(logits, requests)``, on
  random logits and parameters against the package's Sampler: exactly where the spec fixes the
  draw (greedy rows, rows with their own generator), by the distribution where it does not (rows
  drawn from the sampler's own generator), naming the row and the parameter; then the tiny model
  in the engine with seeded requests, side by side with the package's Sampler.
- ``check_worker_order``: one round of the worker on toy caches (each block holds one number),
  against the real CacheEngine driven by ``Worker.execute_model``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from tinyserve import sampler as package_sampler
from tinyserve.cache_engine import CacheEngine
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.exercises.engine_runs import PROMPTS, Run, run_engine, same_tokens, tiny
from tinyserve.exercises.verdict import checker, run_cases, verdict
from tinyserve.model_runner import prepare_inputs
from tinyserve.sampler import SampleRequest
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


# -- the sampler ------------------------------------------------------------------------------------

PackageSampler = package_sampler.Sampler


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    temperature = 0.0 if rng.random() < 0.25 else rng.choice([0.5, 0.8, 1.0, 1.5])
    extra = {}
    if rng.random() < 0.2:  # the chapter's section 9.7 extras, which the spec leaves the package's
        extra = rng.choice([dict(presence_penalty=2.0, frequency_penalty=1.0), dict(repetition_penalty=2.0),
                            dict(min_tokens=4)] + [dict(min_p=0.2)] * (temperature > 0))
    if temperature == 0:
        return SamplingParams(temperature=0.0, **extra)
    return SamplingParams(temperature=temperature, top_k=rng.choice([-1, -1, 1, 3, 10, vocab + 5]),
                          top_p=rng.choice([1.0, 1.0, round(rng.uniform(0.05, 0.95), 3)]), **extra)


def _sampler_case(rng: random.Random, case: int) -> tuple[torch.Tensor, list[tuple]]:
    """Random logits and, per row, (params, num_samples, seed or None, prompt, output, eos). The
    outputs repeat the row's likeliest tokens and EOS is its likeliest, so that the penalties and
    min_tokens change what is drawn."""
    gen = torch.Generator().manual_seed(case)
    rows = rng.randint(1, 6)
    vocab = rng.choice([5, 40, 300])
    logits = torch.randn(rows, vocab, generator=gen) * rng.choice([1.0, 3.0])
    specs = []
    for row in range(rows):
        params = _random_params(rng, vocab)
        n = 1 if params.greedy else rng.choice([1, 1, 3])
        seed = rng.randrange(2**31) if rng.random() < 0.8 else None
        top = logits[row].topk(min(3, vocab)).indices.tolist()
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        output = [rng.choice(top) for _ in range(rng.randint(0, 3))] + [top[0]] * rng.randint(0, 2)
        specs.append((params, n, seed, prompt, output, top[0]))
    return logits, specs


def _requests(specs: list[tuple]) -> list[SampleRequest]:
    """Fresh requests (and generators: each draw advances them) for one call."""
    return [SampleRequest(p, n, None if s is None else torch.Generator().manual_seed(s), prompt, output, eos)
            for p, n, s, prompt, output, eos in specs]


def _shown(p: SamplingParams, n: int, seed) -> str:
    parts = ["greedy (temperature=0)" if p.greedy else f"temperature={p.temperature}"]
    if not p.greedy:
        parts += [f"top_k={p.top_k}"] * (p.top_k != -1) + [f"top_p={p.top_p}"] * (p.top_p < 1.0)
        parts += [f"min_p={p.min_p}"] * (p.min_p > 0)
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_tokens", 0)):
        if getattr(p, name) != default:
            parts.append(f"{name}={getattr(p, name)}")
    parts.append(f"n={n}")
    parts.append("its own generator" if seed is not None else "the sampler's generator")
    return ", ".join(parts)


def _allowed(logits_row: torch.Tensor, request: SampleRequest) -> set[int]:
    """The tokens the package's sampler may draw for this row."""
    probs = PackageSampler._probs(PackageSampler._adjust(logits_row[None], [request]), [request.params])[0]
    return set((probs > 0).nonzero().flatten().tolist())


def _loosened(p: SamplingParams) -> dict[str, tuple[str, SamplingParams | None]]:
    """Each parameter of ``p`` that shapes the distribution, with ``p`` without it (None: without
    the package's ``_adjust``, the penalties and min_tokens)."""
    named = {"temperature": (f"temperature={p.temperature}", dataclasses.replace(p, temperature=1.0)),
             "top_k": (f"top_k={p.top_k}", dataclasses.replace(p, top_k=-1)),
             "top_p": (f"top_p={p.top_p}", dataclasses.replace(p, top_p=1.0)),
             "min_p": (f"min_p={p.min_p}", dataclasses.replace(p, min_p=0.0))}
    out = {}
    if p.has_penalties or p.min_tokens:  # first: without them, any cut may look wrong
        out["adjust"] = ("the penalties and min_tokens (the package's self._adjust, first)", None)
    out.update((k, v) for k, v in named.items() if getattr(v[1], k) != getattr(p, k))
    return out


def _probs_of(logits_row: torch.Tensor, request: SampleRequest, params: SamplingParams | None) -> torch.Tensor:
    rows = logits_row[None] if params is None else PackageSampler._adjust(logits_row[None], [request])
    return PackageSampler._probs(rows, [params or request.params])[0].double()


def _suspect(cls, logits_row: torch.Tensor, request: SampleRequest, drawn: list[int]) -> str:
    """Which parameter a wrong row most likely gets wrong: from the tokens it drew and, for a
    row that draws, from 20000 samples of the reader's sampler on that row alone."""
    p = request.params
    if p.greedy:
        adjusted = int(PackageSampler._adjust(logits_row[None], [request]).argmax())
        if drawn and drawn[0] == int(logits_row.argmax()) != adjusted:
            return f"the argmax before {_loosened(p)['adjust'][0]}; expected {adjusted}"
        return f"a greedy row takes the argmax, {adjusted}"
    loose = _loosened(p)
    expected = _probs_of(logits_row, request, p)
    def probe(seed: int) -> list[int]:
        request_ = SampleRequest(p, 20_000, torch.Generator().manual_seed(seed), request.prompt_token_ids,
                                 request.output_token_ids, request.eos_token_id)
        try:
            return [int(t) for t in cls(0)(logits_row[None].clone(), [request_])[0]]
        except Exception:  # the reader's code: fall back on the tokens it drew
            return []

    many = probe(1)
    support = set((expected > 0).nonzero().flatten().tolist())
    outside = sorted(set(drawn + many) - support)
    if outside:
        for name, (shown, relaxed) in loose.items():
            if set(outside) <= set((_probs_of(logits_row, request, relaxed) > 0).nonzero().flatten().tolist()):
                if name == "temperature":
                    return f"drew {outside[:5]}, which the cut leaves out at {shown}: cut after the temperature"
                if name == "adjust":
                    return f"drew {outside[:5]}, which only a row without {shown} may draw"
                return f"drew {outside[:5]}, which {shown} leaves out"
        return f"drew {outside[:5]}, which the row's parameters leave out"
    if not many:
        return "every token drawn is allowed: check the temperature and the draw"
    if len(set(many)) == 1 < len(support) and len(set(other := probe(2))) == 1 and other != many:
        return (f"its {len(many)} samples of one row are all token {many[0]}: draw num_samples tokens, "
                f"with replacement, not one token repeated")
    freq = torch.bincount(torch.tensor(many), minlength=len(expected)).double() / len(many)
    missing = [t for t in sorted(support, key=lambda t: -float(expected[t])) if expected[t] > 0.002 and freq[t] == 0]
    if missing:
        cuts = [shown for name, (shown, _) in loose.items() if name in ("top_k", "top_p", "min_p")]
        return (f"never drew token {missing[0]} (probability {float(expected[missing[0]]):.3f}), which "
                f"{' and '.join(cuts) or 'the row'} keeps: the cut leaves out too much")
    tv = 0.5 * float((freq - expected).abs().sum())
    if tv > 0.03:
        for shown, relaxed in loose.values():
            if 0.5 * float((freq - _probs_of(logits_row, request, relaxed)).abs().sum()) < 0.02:
                return f"the frequencies of 20000 draws are the distribution without {shown}"
        return f"the frequencies of 20000 draws are {tv:.3f} (total variation) from the expected distribution"
    return ("the distribution is right, the draw is not: one torch.multinomial(probs, num_samples, "
            "replacement=True, generator=...) per row, from the request's generator when it has one")


def _rows_of(got, num_rows: int) -> list:
    if not isinstance(got, (list, tuple)) or len(got) != num_rows:
        raise TypeError(f"returned {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'} "
                        f"entries, expected a list with one entry per row ({num_rows})")
    return list(got)


def _distribution_failure(cls, rng: random.Random, case: int) -> str | None:
    """A row drawn from the sampler's own generator: the spec fixes its distribution, not its
    draws. 20000 samples of one request must be within total variation 0.05 of the package's
    probabilities, draw nothing they exclude, and two samplers of the same seed must agree."""
    vocab = rng.choice([5, 12, 30])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(10_000 + case)) * 2.0
    params = SamplingParams(temperature=rng.choice([0.6, 1.0, 1.7]), top_k=rng.choice([-1, 3, vocab - 1]),
                            top_p=rng.choice([1.0, 0.7, 0.9]))
    request = SampleRequest(params, 20_000)
    shown = f"{vocab} logits, {_shown(params, 20_000, None)}"
    try:
        got = _rows_of(cls(case)(logits.clone(), [request]), 1)[0]
        again = _rows_of(cls(case)(logits.clone(), [SampleRequest(params, 20_000)]), 1)[0]
        drawn = torch.tensor([int(t) for t in got])
    except Exception as e:  # the reader's code: any error is a failed case
        return f"{shown}: raised {type(e).__name__}: {e}"
    if len(drawn) != 20_000:
        return f"{shown}: drew {len(drawn)} tokens, expected num_samples = 20000"
    if [int(t) for t in again] != drawn.tolist():
        return f"{shown}: Sampler({case}) drew other tokens the second time: the sampler's own generator " \
               f"must be seeded with its seed"
    expected = PackageSampler._probs(logits, [params])[0].double()
    outside = sorted(set(drawn.tolist()) - set((expected > 0).nonzero().flatten().tolist()))
    if outside:
        return f"{shown}: {_suspect(cls, logits[0], request, outside)}"
    freq = torch.bincount(drawn, minlength=vocab).double() / len(drawn)
    tv = 0.5 * float((freq - expected).abs().sum())
    if tv > 0.05:
        relaxed = {"temperature": dataclasses.replace(params, temperature=1.0)}
        for name, p in relaxed.items():
            other = PackageSampler._probs(logits, [p])[0].double()
            if getattr(p, name) != getattr(params, name) and 0.5 * float((freq - other).abs().sum()) < 0.03:
                return f"{shown}: the frequencies are the distribution without {name}={getattr(params, name)}"
        return f"{shown}: the frequencies are {tv:.3f} (total variation) from the package's distribution " \
               f"{[round(x, 3) for x in expected.tolist()]}"
    return None


@checker(chapter=9, answer="Sampler")
def check_sampler(cls: type, num_cases: int = 50, seed: int = 0) -> bool:
    """``cls(seed)`` is a sampler; called as ``sampler(logits, requests)`` with float32 logits
    ``[rows, vocab]`` and one SampleRequest per row, it returns per row a list of
    ``num_samples`` Python ints, as the package's Sampler does, without changing ``logits``:

    - greedy rows (temperature 0): the argmax, ``num_samples`` times;
    - a row with its own ``generator`` (a request's seed): exactly the package's draw, one
      ``torch.multinomial(probs, num_samples, replacement=True, generator=request.generator)``
      on the CPU from the row's probabilities after temperature, top-k and top-p (and the
      package's penalties, min_tokens and min_p for the rows that ask);
    - a row without one draws from the sampler's own generator, seeded with ``seed``: any draw
      from the same distribution (checked on 20000 samples), the same for the same seed;
    - a row whose probabilities are not finite comes back as an Exception, the others as usual.

    Then the tiny model runs s0/s1/s2 in the real engine with ``sampler=cls(0)`` (seeded top-k,
    top-p and n=2 requests beside a greedy one): the tokens must be the package's Sampler's."""
    rng = random.Random(seed)
    failures = []
    for case in range(num_cases):
        logits, specs = _sampler_case(rng, seed * 1000 + case)
        if case == 0:  # a row of NaN logits fails alone
            logits[0] = float("nan")
            specs[0] = (SamplingParams(temperature=1.0), 1, 3, [0], [], 0)
        want = PackageSampler(case)(logits.clone(), _requests(specs))
        requests = _requests(specs)
        given = logits.clone()
        try:
            got = _rows_of(cls(case)(given, requests), len(specs))
        except Exception as e:  # the reader's code: any error is a failed case
            failures.append(f"{logits.shape[0]} rows of {logits.shape[1]} logits: raised {type(e).__name__}: {e}")
            continue
        if not torch.equal(given.nan_to_num(), logits.nan_to_num()):
            failures.append(f"{logits.shape[0]} rows of {logits.shape[1]} logits: changed the logits in place "
                            f"(the engine reads the tokens' logprobs from them afterwards)")
            continue
        for row, ((p, n, s, *_), mine, expected) in enumerate(zip(specs, got, want)):
            where = f"row {row} of {len(specs)} ({logits.shape[1]} logits; {_shown(p, n, s)})"
            if isinstance(expected, Exception):
                if not isinstance(mine, Exception):
                    failures.append(f"{where}: its logits are NaN; expected an Exception for this row, got {mine!r}")
                continue
            if isinstance(mine, Exception):
                failures.append(f"{where}: came back as {type(mine).__name__}: {mine}")
                continue
            if not isinstance(mine, (list, tuple)) or not all(type(t) is int for t in mine):
                failures.append(f"{where}: expected a list of Python ints, got {mine!r}")
                continue
            if len(mine) != n:
                failures.append(f"{where}: drew {len(mine)} tokens, expected num_samples = {n}")
            elif s is None and not p.greedy:  # the sampler's own generator: only the support is fixed
                outside = sorted(set(mine) - _allowed(logits[row], requests[row]))
                if outside:
                    failures.append(f"{where}: {_suspect(cls, logits[row], requests[row], mine)}")
            elif list(mine) != list(expected):
                why = _suspect(cls, logits[row], _requests(specs)[row], list(mine)) if len(failures) < 3 else ""
                failures.append(f"{where}: drew {list(mine)}, expected {list(expected)}" + (why and f": {why}"))
    for case in range(4):
        problem = _distribution_failure(cls, rng, case)
        if problem:
            failures.append(problem)
    if not failures:
        params = {"s0": SamplingParams(temperature=0.9, top_p=0.6, seed=1, max_tokens=10, ignore_eos=True),
                  "s1": SamplingParams(n=2, temperature=1.2, top_k=5, seed=2, max_tokens=10, ignore_eos=True),
                  "s2": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)}
        package = run_engine("package's Sampler", params=params)
        yours = run_engine("your Sampler", params=params, sampler=cls(0))
        if not same_tokens(yours, package):
            failures.append(f"in the engine: {yours.error or f'tokens {yours.tokens}, expected {package.tokens}'}")
    return verdict("sampler", failures, num_cases + 5)


# -- the worker's order of operations ----------------------------------------------------------------

class _ToyWorker:
    """Stands in for a Worker whose "model" writes one value per new token at its slot."""

    def __init__(self, cache_engine: CacheEngine, writes: dict[int, int]) -> None:
        self.cache_engine = cache_engine
        self.block_size = 1
        self.device = torch.device("cpu")
        self.writes = writes
        self.prepare_inputs = prepare_inputs

    def run(self, inputs) -> torch.Tensor:
        k_cache = self.cache_engine.gpu_cache[0][0]
        for slot in inputs.attn_metadata.slot_mapping.tolist():
            k_cache[slot, 0, 0, 0] = float(self.writes[slot])
        return torch.zeros(len(inputs.sample_indices), 1)


def worker_order_reference(gpu: list[int], cpu: list[int], swap_out: dict[int, int], swap_in: dict[int, int],
                           copy: dict[int, list[int]], writes: dict[int, int]) -> tuple[list[int], list[int]]:
    """Run ``Worker.execute_model`` on a real CacheEngine whose blocks hold one number each
    (block size 1, one layer, one head of width 1); the model writes ``writes[block]``."""
    cache = CacheEngine(CacheConfig(block_size=1, num_gpu_blocks=len(gpu), num_cpu_blocks=len(cpu), watermark=0.0),
                        num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float64, device="cpu")
    cache.gpu_cache[0][0][:, 0, 0, 0] = torch.tensor(gpu, dtype=torch.float64)
    if cpu:
        cache.cpu_cache[0][0][:, 0, 0, 0] = torch.tensor(cpu, dtype=torch.float64)
    groups = []
    for i, block in enumerate(writes):
        seq = Sequence(i, None, [0], 1)
        groups.append(SequenceGroupMetadata(request_id=f"r{i}", is_prompt=True, seq_data={i: seq},
                                            sampling_params=SamplingParams(), block_tables={i: [block]},
                                            token_chunk_size=1))
    Worker.execute_model(_ToyWorker(cache, writes), groups, dict(swap_in), dict(swap_out),
                         {s: list(d) for s, d in copy.items()})
    read = lambda pool: [int(v) for v in pool[0][0][:, 0, 0, 0].tolist()]  # noqa: E731
    return read(cache.gpu_cache), read(cache.cpu_cache)


def _order_cases(num_cases: int, seed: int) -> list[tuple]:
    """Rounds whose orders collide: a block swapped out is reused (as a copy destination, a
    swap-in destination or a new token's slot); a swapped-in block is a copy's source."""
    rng = random.Random(seed)
    # Round 3 of the walkthrough: s2's block 2 goes to CPU block 0 and s1's new token lands in it.
    cases = [([100, 101, 102, 103], [200, 201, 202, 203], {2: 0}, {}, {}, {3: 300, 2: 301})]
    while len(cases) < num_cases:
        num_gpu, num_cpu = rng.randint(4, 9), rng.randint(2, 6)
        gpu = [100 + i for i in range(num_gpu)]
        cpu = [200 + i for i in range(num_cpu)]
        blocks = rng.sample(range(num_gpu), num_gpu)
        cpu_blocks = rng.sample(range(num_cpu), num_cpu)
        n_out = rng.randint(0, min(2, num_cpu))
        swap_out = {blocks[i]: cpu_blocks[i] for i in range(n_out)}
        freed = list(swap_out)
        # Swap-in reads CPU blocks other than the ones written by this round's swap-out.
        spare_cpu = cpu_blocks[n_out:]
        swap_in: dict[int, int] = {}
        copy: dict[int, list[int]] = {}
        writes: dict[int, int] = {}
        others = blocks[n_out:]
        if spare_cpu and rng.random() < 0.5:
            dst = freed.pop() if freed and rng.random() < 0.6 else others.pop()
            swap_in[rng.choice(spare_cpu)] = dst
        if others and rng.random() < 0.7:
            # The copy's source: a block swapped in this round, or any block still in place.
            src = next(iter(swap_in.values())) if swap_in and rng.random() < 0.5 else others.pop()
            dst = freed.pop() if freed and rng.random() < 0.6 else (others.pop() if others else None)
            if dst is not None and dst != src:
                copy[src] = [dst]
                if rng.random() < 0.5:
                    writes[dst] = 0  # the new token lands in the fresh copy
        for b in freed + others[: rng.randint(0, 2)] + list(swap_in.values())[: rng.randint(0, 1)]:
            writes.setdefault(b, 0)
        if not writes:
            writes[rng.randrange(num_gpu)] = 0
        writes = {b: 300 + i for i, b in enumerate(writes)}
        cases.append((gpu, cpu, swap_out, swap_in, copy, writes))
    return cases


@checker(chapter=9, answer="apply_round")
def check_worker_order(fn: Callable[..., tuple[list[int], list[int]]], num_cases: int = 60, seed: int = 0) -> bool:
    """``fn(gpu, cpu, swap_out, swap_in, copy, writes)`` plays one round of the worker on toy
    caches in which each block holds one number (``gpu[b]``, ``cpu[c]``): ``swap_out`` {gpu block:
    cpu block}, ``swap_in`` {cpu block: gpu block}, ``copy`` {gpu src: [gpu dsts]} and ``writes``
    {gpu block: value}, what the model stores for the round's new tokens. It returns the final
    ``(gpu, cpu)`` lists, without changing its arguments."""
    def given(gpu, cpu, swap_out, swap_in, copy, writes):
        got_gpu, got_cpu = fn(list(gpu), list(cpu), dict(swap_out), dict(swap_in),
                              {s: list(d) for s, d in copy.items()}, dict(writes))
        return [int(v) for v in got_gpu], [int(v) for v in got_cpu]

    cases = [(case, worker_order_reference(*case)) for case in _order_cases(num_cases, seed)]
    return run_cases("worker_order", given, cases,
                     describe=lambda a: f"gpu={a[0]}, cpu={a[1]}, swap_out={a[2]}, swap_in={a[3]}, copy={a[4]}, "
                                        f"writes={a[5]}")
