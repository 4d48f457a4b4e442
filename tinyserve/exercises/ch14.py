"""The checker of chapter 14's exercise, ``check_beam_select``: the reader's beam step, the function
that decides which of a step's candidates survive, which finished beams are kept, which are
dropped, and whether the search stops (the package's is ``beam_search.select``).

It runs in three parts. Random steps (children of one step, finished beams kept from earlier
steps, widths, length penalties, the three ``early_stopping`` modes), each compared with the
package's decision, a failure naming the rule it breaks. Then the reader's function inside the
real engine (``LLMEngine(beam_select=...)``) on the tiny random Llama, beside the package's, on
beam searches of several widths, penalties and stopping modes: the returned beams and their
scores must be the same. Then transformers' own beam search (``generate(num_beams=W)``) on the
same weights, with ``length_penalty=0``, where its scores are the cumulative log-probabilities
too: the same beams, scores within 1e-4.
"""

from __future__ import annotations

import functools
import random

import torch

from tinyserve import beam_search
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.exercises.engine_runs import PROMPTS, tiny
from tinyserve.exercises.verdict import checker, verdict
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence, SequenceStatus
from tinyserve.worker import Worker

EOS = 2
RULES = {
    1: "rule 1: the finished beams, this step's and those kept before, are ranked together by beam score "
       "(beam_score) and the best W kept; a new one outside them is dropped, an old one pushed out",
    2: "rule 2: with no running candidate left, the search stops",
    3: "rule 3: with fewer than W finished beams kept, the search goes on",
    4: "rule 4: with W kept, should_stop decides, given the best running candidate and the worst kept finished one",
    5: "rule 5: if the search goes on, the W best running candidates (by beam score) go on and the others are "
       "dropped; if it stops, every running candidate is dropped",
}


# -- random steps ------------------------------------------------------------------------------


def _seq(seq_id: int, prompt_len: int, out_len: int, cumulative: float, status: SequenceStatus) -> Sequence:
    seq = Sequence(seq_id, None, [5] * prompt_len, 4)
    for i in range(out_len):
        last = i == out_len - 1
        seq.append_token_id(EOS if last and status is SequenceStatus.FINISHED_STOPPED else 7 + i % 3)
    seq.cumulative_logprob = cumulative
    seq.status = status
    return seq


def random_step(rng: random.Random) -> tuple:
    """(children, finished, width, length_penalty, early_stopping, eos_token_id, max_len): one
    step's arguments as the engine passes them. The children all took their token this step (one
    length); the finished beams of earlier steps are shorter and kept best first."""
    width = rng.randint(2, 5)
    prompt_len = rng.randint(1, 6)
    step = rng.randint(1, 9)
    max_tokens = step + rng.choice([0, 0, 1, 3, 8])
    at_limit = step == max_tokens
    ids = iter(range(1000))
    children = []
    for _ in range(rng.randint(1, 2 * width)):
        eos = rng.random() < rng.choice([0.0, 0.2, 0.5, 0.9])
        status = (SequenceStatus.FINISHED_STOPPED if eos else
                  SequenceStatus.FINISHED_LENGTH_CAPPED if at_limit else SequenceStatus.RUNNING)
        children.append(_seq(next(ids), prompt_len, step, -rng.uniform(0.1, 3.0) * step, status))
    finished = []
    for _ in range(rng.choice([0, 0, 1, width - 1, width, width])):
        n = rng.randint(1, max(1, step - 1))
        finished.append(_seq(next(ids), prompt_len, n, -rng.uniform(0.1, 3.0) * n, SequenceStatus.FINISHED_STOPPED))
    rng.shuffle(children)
    length_penalty = rng.choice([0.0, 0.5, 1.0, 1.0, 2.0, -1.0])
    early_stopping = rng.choice([True, False, "never"])
    return children, finished, width, length_penalty, early_stopping, EOS, prompt_len + max_tokens


def _beam_ids(seqs) -> list[int]:
    return sorted(s.seq_id for s in seqs)


def _describe(args: tuple) -> str:
    children, finished, width, lp, es, _, max_len = args
    running = sum(not c.is_finished() for c in children)
    return (f"W={width}, {len(children)} children ({running} running, {len(children) - running} finished), "
            f"{len(finished)} finished before, length_penalty={lp}, early_stopping={es!r}, max_len={max_len}")


def _shape_problem(got, args: tuple) -> str | None:
    children, finished = args[0], args[1]
    if not all(hasattr(got, a) for a in ("keep", "drop", "drop_finished", "stop")):
        return f"returned {got!r}: return a beam_search.Selection(keep, drop, drop_finished, stop)"
    if not isinstance(got.stop, bool):
        return f"stop is {got.stop!r}: it must be True or False"
    try:
        keep, drop, pushed = _beam_ids(got.keep), _beam_ids(got.drop), _beam_ids(got.drop_finished)
    except (AttributeError, TypeError):
        return "keep, drop and drop_finished must be lists of the sequences given"
    if sorted(keep + drop) != _beam_ids(children):
        return (f"keep and drop hold seq ids {sorted(keep + drop)}; every child ({_beam_ids(children)}) must be in "
                f"exactly one of them")
    if not set(pushed) <= set(_beam_ids(finished)):
        return f"drop_finished holds {pushed}, which are not finished beams of earlier steps ({_beam_ids(finished)})"
    return None


def _broken_rule(got, want, args: tuple) -> str:
    """Which rule a wrong decision breaks (the first that differs, in the order a step applies them)."""
    children, finished, width = args[0], args[1], args[2]
    new_done = {c.seq_id for c in children if c.is_finished()}
    mine_kept_done = {s.seq_id for s in got.keep} & new_done
    if mine_kept_done != ({s.seq_id for s in want.keep} & new_done) or _beam_ids(got.drop_finished) != _beam_ids(
            want.drop_finished):
        return RULES[1]
    if got.stop != want.stop:
        if not any(not c.is_finished() for c in children):
            return RULES[2]
        kept = len(finished) - len(want.drop_finished) + len(new_done & {s.seq_id for s in want.keep})
        return RULES[3] if kept < width else RULES[4]
    return RULES[5]


def _compare(fn, args: tuple) -> str | None:
    want = beam_search.select(*args)
    try:
        got = fn(*args)
    except NotImplementedError:
        raise  # not written yet: %%workspace says so, rather than 400 failed cases
    except Exception as e:  # the reader's code: any error is a failed case
        return f"{_describe(args)}: raised {type(e).__name__}: {e}"
    problem = _shape_problem(got, args)
    if problem:
        return f"{_describe(args)}: {problem}"
    same = (_beam_ids(got.keep) == _beam_ids(want.keep) and _beam_ids(got.drop) == _beam_ids(want.drop)
            and _beam_ids(got.drop_finished) == _beam_ids(want.drop_finished) and got.stop == want.stop)
    if same:
        return None
    return (f"{_describe(args)}: kept {_beam_ids(got.keep)}, dropped {_beam_ids(got.drop)}, pushed out "
            f"{_beam_ids(got.drop_finished)}, stop={got.stop}; expected kept {_beam_ids(want.keep)}, dropped "
            f"{_beam_ids(want.drop)}, pushed out {_beam_ids(want.drop_finished)}, stop={want.stop}: "
            f"{_broken_rule(got, want, args)}")


# -- in the engine -----------------------------------------------------------------------------

ENGINE_CASES = [  # (width, n, max_tokens, length_penalty, early_stopping)
    (2, 2, 6, 0.0, False), (3, 2, 9, 0.0, True), (4, 4, 5, 0.0, "never"), (4, 1, 12, 0.0, False),
    (3, 3, 8, 1.0, False), (4, 2, 10, 2.0, "never"), (5, 3, 7, -1.0, True), (2, 1, 14, 0.5, False),
]


def _params(width, n, max_tokens, length_penalty, early_stopping) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0.0, max_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping)


def engine_beams(beam_select=None, cases=ENGINE_CASES, loaded=None) -> dict:
    """``{(case, prompt id): [(token ids, cumulative logprob) of each returned beam]}`` from the real
    engine on the tiny model, with ``beam_select`` (None: the package's); an exception stops the
    run and is returned as the error string under the key "error"."""
    loaded = loaded if loaded is not None else tiny()
    model_config = ModelConfig(model=str(loaded.path or "in-memory"))
    got: dict = {}
    try:
        cache = CacheConfig(block_size=4, num_gpu_blocks=512, num_cpu_blocks=64, watermark=0.0)
        engine = LLMEngine(model_config, cache,
                           SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=64),
                           executor=Worker(model_config, attention_backend="torch", loaded=loaded),
                           beam_select=beam_select)
        for c, case in enumerate(cases):
            for rid, prompt in PROMPTS.items():
                engine.add_request(f"{c}-{rid}", prompt, _params(*case))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        c_, rid = out.request_id.split("-")
                        got[(int(c_), rid)] = [(list(o.token_ids), o.cumulative_logprob) for o in out.outputs]
    except Exception as e:  # the reader's function inside the engine: report, do not stop the chapter
        got["error"] = f"{type(e).__name__}: {e}"
    return got


@functools.cache
def _hf_model():
    """transformers' Llama with the tiny model's weights (``random_state_dict``, the same seed)."""
    from transformers import LlamaForCausalLM

    from tinyserve.models.loader import random_state_dict

    loaded = tiny()
    hf = LlamaForCausalLM(loaded.hf_config).float().eval()
    hf.load_state_dict(random_state_dict(loaded.hf_config, 0))
    return hf


def transformers_beams(cases=ENGINE_CASES) -> dict:
    """transformers' ``generate(num_beams=W)`` for the cases with ``length_penalty=0``, keyed as
    ``engine_beams``: a returned beam is its tokens up to its EOS, with its score."""
    tok, hf = tiny().tokenizer, _hf_model()
    out: dict = {}
    for c, (width, n, max_tokens, lp, es) in enumerate(cases):
        if lp != 0.0:
            continue
        for rid, prompt in PROMPTS.items():
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                res = hf.generate(ids, num_beams=width, num_return_sequences=n, do_sample=False,
                                  max_new_tokens=max_tokens, length_penalty=lp, early_stopping=es,
                                  return_dict_in_generate=True, output_scores=True,
                                  pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
            beams = []
            for seq, score in zip(res.sequences, res.sequences_scores.tolist()):
                gen = seq[ids.shape[1]:].tolist()
                if tok.eos_token_id in gen:  # transformers pads a beam that ended after its EOS
                    gen = gen[:gen.index(tok.eos_token_id) + 1]
                beams.append((gen, score))
            out[(c, rid)] = beams
    return out


def _beams_differ(mine: list, want: list, tolerance: float) -> str | None:
    for i, ((tokens, score), (want_tokens, want_score)) in enumerate(zip(mine, want)):
        if tokens != want_tokens:
            return f"beam {i}: tokens {tokens}, expected {want_tokens}"
        if abs(score - want_score) > tolerance:
            return f"beam {i}: score {score:.5f}, expected {want_score:.5f}"
    return None if len(mine) == len(want) else f"{len(mine)} beams returned, expected {len(want)}"


def _beam_engine_failures(fn) -> tuple[list[str], int]:
    mine, package, hf = engine_beams(fn), engine_beams(None), transformers_beams()
    if "error" in mine:
        return [f"in the engine: raised {mine['error']}"], 1
    failures = []
    for key, want in package.items():
        problem = _beams_differ(mine.get(key, []), want, 1e-6)
        if problem:
            c = ENGINE_CASES[key[0]]
            failures.append(f"in the engine, {key[1]} with width {c[0]}, n={c[1]}, max_tokens={c[2]}, "
                            f"length_penalty={c[3]}, early_stopping={c[4]!r}: {problem} (the package's select)")
    for key, want in hf.items():
        problem = _beams_differ(mine.get(key, []), want, 1e-4)
        if problem:
            failures.append(f"in the engine, {key[1]} with width {ENGINE_CASES[key[0]][0]}: {problem} "
                            f"(transformers' generate(num_beams=...))")
    return failures, len(package) + len(hf)


@checker(chapter=14, answer="beam_select")
def check_beam_select(fn, num_cases: int = 400, seed: int = 0) -> bool:
    """``fn(children, finished, width, length_penalty, early_stopping, eos_token_id, max_len)``
    returns a ``beam_search.Selection(keep, drop, drop_finished, stop)`` as the package's
    ``beam_search.select`` does, by the rules of section 14.3 (``RULES``): on ``num_cases`` random
    steps, then in the real engine on the tiny model beside the package's select (the same beams
    and scores) and beside transformers' beam search (the same beams, scores within 1e-4)."""
    rng = random.Random(seed)
    failures = [p for p in (_compare(fn, random_step(rng)) for _ in range(num_cases)) if p]
    total = num_cases
    if not failures:
        more, n = _beam_engine_failures(fn)
        failures += more
        total += n
    return verdict("beam_select", failures, total)
