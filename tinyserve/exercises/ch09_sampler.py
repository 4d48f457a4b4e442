"""The checker of chapter 09's sampler exercise, ``check_sampler``: the reader's ``Sampler`` class,
``Sampler(seed)(logits, requests)``, on random logits and parameters against the package's
Sampler: exactly where the spec fixes the draw (greedy rows, rows with their own generator), by
the distribution where it does not (rows drawn from the sampler's own generator), naming the row
and the parameter; then the tiny model in the engine with seeded requests, side by side with the
package's Sampler.
"""


from __future__ import annotations

import dataclasses
import random

import torch

from tinyserve import sampler as package_sampler
from tinyserve.exercises.engine_runs import run_engine, same_tokens
from tinyserve.exercises.verdict import checker, verdict
from tinyserve.sampler import SampleRequest
from tinyserve.sampling_params import SamplingParams

# -- the sampler's cases --------------------------------------------------------------------------

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
