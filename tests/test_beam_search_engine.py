"""Beam search in the engine (issue 37): transformers as the oracle, wider, and under every policy.

**The oracle** is transformers 5's own beam search (``generate(num_beams=W, num_return_sequences=n,
do_sample=False)``, ``GenerationMixin._beam_search``) on the same float32 weights: tiny random
Llamas of several seeds whose EOS row of ``lm_head`` is pushed toward the model's average hidden
state, so that EOS is among the likeliest tokens at many positions and beams end early, and once
on SmolLM2. v0.4 (and tinyserve) differ from transformers 5 in three rules, each named here and
made executable by ``v04_rules``, which wraps two of transformers' private steps so that they
follow v0.4's rule and nothing else changes:

1. **Which candidates may finish** (``"finish"``). Each step both take the 2W best continuations
   over all beams. transformers lets a continuation that ends in EOS become a finished hypothesis
   only if it ranks among the first W of the 2W (``_update_finished_beams``' ``top_num_beam_mask``);
   v0.4 ranks every finished child, whatever its rank, with the finished kept so far and keeps
   the best W (``LLMEngine._process_sequence_group_outputs``). This is the one difference left at
   ``length_penalty=0``: there, tokens and scores agree exactly (1e-4) once this rule is v0.4's,
   and where plain transformers differs, a returned beam ends in EOS (it is such a candidate).
2. **A beam's length** in its score, cumulative logprob / length ** length_penalty
   (``"length"``). v0.4 (``Sequence.get_beam_search_score``) counts the prompt and the generated
   tokens, a final EOS not counted; transformers 5 counts the generated tokens only, a final EOS
   included (``_update_finished_beams``: ``cur_len + 1 - decoder_prompt_len``;
   ``_check_early_stop_heuristic``: ``cur_len - decoder_prompt_len`` for the best running beam).
   Beams of equal length rank alike under both, so where no beam ends early (all run to
   ``max_tokens``) the definitions coincide and plain transformers agrees with a length penalty too.
3. **The longest a beam could grow** for ``early_stopping="never"`` with ``length_penalty > 0``
   (``"never"``): v0.4 ``max(prompt_len + max_tokens, max_model_len)``, transformers
   ``max_length - decoder_prompt_len`` (= max_new_tokens). Both are at least the longest a beam
   can really grow, so neither stops while a running beam could still win: this rule can change
   how many steps run, never the beams returned (in the cases tried it changed neither).

With the three rules v0.4's, transformers returns tinyserve's beams token for token and v0.4's
scores within 1e-4 for every width, length, n, penalty and ``early_stopping`` tried. As an
independent check of tinyserve's own scoring, transformers' finished hypotheses are rescored with
v0.4's formula (their cumulative logprob recovered from transformers' score).

One difference from v0.4 itself is in the reported beams, not the search: v0.4's
``RequestOutput.from_seq_group`` ranks the W finished beams by ``get_beam_search_score(
length_penalty)`` without ``eos_token_id``, so there a final EOS counts in the length (the search
does not count it); tinyserve (``outputs.py``) and transformers rank them by the search's own
score. With a length penalty and beams ending in EOS, v0.4 can report another n of the W or
another order (10 of 432 runs at n=2 on these models).

**The engine**: beam requests mixed with sampled (seeded) and greedy ones under the three
policies, prefix caching, chunked prefill and a KV cache small enough to preempt, in both
preemption modes, give each request what it gets alone with ample memory, and every block back.
A group of several beams is swapped even under ``preemption_mode="recompute"`` and under v1 (its
beams cannot come back through one prompt, ``tinyserve/preemption.py``, as v0.4's
``_preempt_by_recompute`` supports one sequence only); a beam request still in its prompt (one
sequence, prefilled in pieces) is recomputed under those two, and swapped under the default
rule, which counts the W sequences it will run. With no swap space a beam group that must leave
is given up alone, with a retryable error, and the others go on.

Two near-tied candidates (a few 1e-6 apart, float32 against float64 sums) could be ordered
differently by the two implementations; the cases here have none.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.beam_search import beam_score
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.models.tiny import make_tiny_model_dir
from tinyserve.scheduler_outputs import PreemptionMode
from tinyserve.sequence import Sequence
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "What is the capital of France?"]
MAX_MODEL_LEN = 128
ALL_RULES = frozenset({"finish", "length", "never"})


def beams(width: int, n: int = 1, max_tokens: int = 10, length_penalty: float = 0.0, early_stopping=False,
          **kw) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0, max_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping, **kw)


# -- the EOS-heavy tiny Llamas and transformers' beam search ---------------------------------------

def make_eos_heavy_model(path: Path, seed: int):
    """The tiny Llama of ``seed`` with its EOS row of ``lm_head`` pushed halfway toward the mean
    final hidden state: EOS, almost never likely before, is then among the likeliest tokens at
    many positions, so beams end at many lengths (most beams the oracle tests return end in EOS).
    Returns the transformers model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_tiny_model_dir(path, seed=seed)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    with torch.no_grad():
        ids = tok(PROMPTS, return_tensors="pt", padding=True).input_ids
        mean = hf.model(ids).last_hidden_state.reshape(-1, hf.config.hidden_size).mean(0)
        row = hf.lm_head.weight[tok.eos_token_id]
        row += 0.5 * row.norm() * mean / mean.norm()
    hf.save_pretrained(str(path))
    return hf, tok


@pytest.fixture(scope="module")
def eos_models(tmp_path_factory):
    """seed -> (LLM, transformers model, tokenizer), built on first use."""
    built = {}

    def get(seed: int):
        if seed not in built:
            path = tmp_path_factory.mktemp(f"eos-heavy-{seed}")
            hf, tok = make_eos_heavy_model(path, seed)
            llm = LLM(model=str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks=512,
                      num_cpu_blocks=0)
            built[seed] = llm, hf, tok
        return built[seed]
    return get


@contextlib.contextmanager
def v04_rules(hf, eos: int, rules=ALL_RULES, max_model_len: int = MAX_MODEL_LEN):
    """transformers' beam search with the named ``rules`` (module docstring) replaced by v0.4's."""
    update, heuristic = hf._update_finished_beams, hf._check_early_stop_heuristic
    calls = []

    def v04_update(**kw):
        calls.append(kw["cur_len"])
        if "finish" in rules:  # every finished candidate of the 2W is ranked, not only the first W
            kw["top_num_beam_mask"] = torch.ones_like(kw["top_num_beam_mask"])
        if "length" in rules:
            # transformers divides by (generated tokens, EOS included) ** penalty; undo that and
            # divide by v0.4's length: prompt + generated, a final EOS not counted.
            cur, lp = kw["cur_len"], kw["length_penalty"]
            ends_in_eos = kw["topk_running_sequences"][:, :, cur] == eos
            v04_len = (cur + 1 - ends_in_eos.double()) ** lp
            kw["topk_log_probs"] = (kw["topk_log_probs"] * (cur + 1 - kw["decoder_prompt_len"]) ** lp
                                    / v04_len).float()
        return update(**kw)

    def v04_heuristic(**kw):
        if "length" in rules:  # the best running beam's length: prompt + generated
            kw["decoder_prompt_len"] = 0
        if "never" in rules:
            kw["max_length"] = max(kw["max_length"], max_model_len)
        return heuristic(**kw)

    hf._update_finished_beams, hf._check_early_stop_heuristic = v04_update, v04_heuristic
    try:
        yield calls
    finally:
        del hf._update_finished_beams, hf._check_early_stop_heuristic
    assert calls, "transformers' beam search no longer calls _update_finished_beams: v04_rules needs updating"


def hf_beams(hf, tok, prompt: str, params: SamplingParams, num_return: int | None = None):
    """transformers' returned beams (generated ids, cut after EOS) and their scores."""
    ids = tok(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=params.best_of,
                      num_return_sequences=num_return or params.n, do_sample=False,
                      max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                      early_stopping=params.early_stopping, output_scores=True, return_dict_in_generate=True,
                      pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    seqs = []
    for s in out.sequences:
        gen = s[ids.shape[1]:].tolist()
        if tok.eos_token_id in gen:  # transformers pads a beam that ended after its EOS
            gen = gen[:gen.index(tok.eos_token_id) + 1]
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


def v04_score(cumulative: float, prompt_len: int, tokens: list[int], eos: int, length_penalty: float) -> float:
    """v0.4's get_beam_search_score written out: the prompt counts, a final EOS does not."""
    return cumulative / (prompt_len + len(tokens) - (tokens[-1] == eos)) ** length_penalty


def compare(llm, hf, tok, params: SamplingParams, rules, prompts=PROMPTS):
    """tinyserve's beams against transformers' under ``rules``: per prompt (tokens equal, scores
    within 1e-4, tinyserve's tokens, transformers' tokens)."""
    eos = tok.eos_token_id
    results = []
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        got = [list(c.token_ids) for c in out.outputs]
        scores = [v04_score(c.cumulative_logprob, len(out.prompt_token_ids), list(c.token_ids), eos,
                            params.length_penalty) for c in out.outputs]
        with v04_rules(hf, eos, rules, llm.engine.scheduler_config.max_model_len):
            expected, theirs = hf_beams(hf, tok, prompt, params)
        close = got == expected and scores == pytest.approx(theirs, abs=1e-4)
        results.append((close, got, expected))
    return results


# -- 1. transformers as the oracle ------------------------------------------------------------------

LP0_CASES = [(2, 1, 10, False), (3, 2, 8, True), (5, 2, 12, "never"), (8, 3, 10, False), (4, 2, 1, False)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_at_length_penalty_0_the_beams_are_transformers_beams_once_any_finished_candidate_may_finish(
        eos_models, seed):
    llm, hf, tok = eos_models(seed)
    eos_positions, plain_differs = set(), 0
    for width, n, max_tokens, early_stopping in LP0_CASES:
        params = beams(width, n, max_tokens, 0.0, early_stopping)
        for close, got, expected in compare(llm, hf, tok, params, {"finish"}):
            assert close, (width, n, max_tokens, early_stopping, got, expected)
            eos_positions |= {len(g) for g in got if g[-1] == tok.eos_token_id}
        for prompt, (close, got, expected) in zip(PROMPTS, compare(llm, hf, tok, params, set())):
            if not close:  # plain transformers: only a beam that ended in EOS can make the difference
                plain_differs += 1
                assert any(g[-1] == tok.eos_token_id for g in got), (prompt, got, expected)
    assert len(eos_positions) >= 3, eos_positions  # beams end early, at several lengths
    if seed == 0:
        assert plain_differs > 0  # the rule decides real cases on this model


def test_the_finishing_rule_is_the_difference_at_length_penalty_0(eos_models):
    """Width 8: v0.4 keeps finished beams that transformers drops (they ended in EOS as one of the
    last W of the 2W continuations); with that rule alone changed, transformers keeps them too."""
    llm, hf, tok = eos_models(0)
    params = beams(8, 2, 6)
    out = llm.generate(PROMPTS[:1], params)[0]
    got = [list(c.token_ids) for c in out.outputs]
    with v04_rules(hf, tok.eos_token_id, {"finish"}):
        assert hf_beams(hf, tok, PROMPTS[0], params)[0] == got
    with v04_rules(hf, tok.eos_token_id, set()):
        plain = hf_beams(hf, tok, PROMPTS[0], params)[0]
    dropped = [g for g in got if g not in plain]
    assert dropped and all(g[-1] == tok.eos_token_id for g in dropped), (got, plain)


# (2.0, True, 4, 2, 12) stops on some prompts with beams that early_stopping=False would not return.
PENALTY_CASES = [(-0.7, False, 4, 2, 10), (0.5, "never", 3, 1, 10), (1.0, True, 6, 2, 8), (2.0, False, 8, 2, 12),
                 (1.5, "never", 4, 2, 8), (2.0, True, 4, 2, 12), (0.3, "never", 7, 7, 5)]


@pytest.mark.parametrize("seed", [0, 1])
def test_with_a_length_penalty_the_beams_are_transformers_beams_under_v04s_three_rules(eos_models, seed):
    llm, hf, tok = eos_models(seed)
    length_rule_decides = 0
    for length_penalty, early_stopping, width, n, max_tokens in PENALTY_CASES:
        params = beams(width, n, max_tokens, length_penalty, early_stopping)
        for close, got, expected in compare(llm, hf, tok, params, ALL_RULES):
            assert close, (length_penalty, early_stopping, width, n, max_tokens, got, expected)
        # Without v0.4's lengths transformers returns other beams, and only where a beam ended early.
        for _, got, expected in compare(llm, hf, tok, params, {"finish", "never"}):
            if got != expected:
                length_rule_decides += 1
                assert any(len(g) < max_tokens for g in got + expected), (got, expected)
    assert length_rule_decides > 0


def test_where_no_beam_ends_early_plain_transformers_agrees_with_a_length_penalty(tiny_model_dir):
    """Where no candidate of any step ends in EOS, every beam has the same length at every step
    under both definitions, so plain transformers (none of the three rules) returns tinyserve's
    beams, and its score times max_tokens ** length_penalty is tinyserve's cumulative logprob.
    On the plain tiny Llama (EOS rarely likely), where most runs are such."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks=256,
              num_cpu_blocks=0)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine, eos = llm.engine, tok.eos_token_id
    select, saw_eos = engine.beam_select, []

    def watching(children, *args):
        saw_eos.append(any(c.get_last_token_id() == eos for c in children))
        return select(children, *args)
    engine.beam_select = watching
    compared = 0
    try:
        for length_penalty, early_stopping in [(-0.5, False), (1.0, True), (2.0, "never")]:
            params = beams(4, 2, 6, length_penalty, early_stopping)
            for prompt in PROMPTS:
                saw_eos.clear()
                out = llm.generate([prompt], params)[0]
                if any(saw_eos):
                    continue
                compared += 1
                with v04_rules(hf, eos, set()):
                    expected, scores = hf_beams(hf, tok, prompt, params)
                assert [list(c.token_ids) for c in out.outputs] == expected
                assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
                    [s * 6 ** length_penalty for s in scores], abs=1e-4)
    finally:
        engine.beam_select = select
    assert compared >= 3


def test_transformers_hypotheses_rescored_with_v04s_formula_are_tinyserves_scores(eos_models):
    """transformers' W finished hypotheses (plain, length_penalty 1): each one's cumulative logprob
    is its score times its length (generated tokens, EOS included); rescored with v0.4's formula,
    each that tinyserve also returns has tinyserve's own beam score (``beam_search.beam_score``
    of a sequence with those tokens and tinyserve's cumulative logprob), and the ones both found
    rank as tinyserve returns them."""
    llm, hf, tok = eos_models(2)
    eos, matched = tok.eos_token_id, 0
    params = beams(4, 4, 8, 1.0, False)
    for prompt in PROMPTS:
        out = llm.generate([prompt], params)[0]
        prompt_ids = list(out.prompt_token_ids)
        mine = {tuple(c.token_ids): tinyserve_score(prompt_ids, c, eos, 1.0) for c in out.outputs}
        assert list(mine.values()) == sorted(mine.values(), reverse=True)
        with v04_rules(hf, eos, set()):
            seqs, scores = hf_beams(hf, tok, prompt, params, num_return=4)
        rescored = {tuple(t): v04_score(s * len(t), len(prompt_ids), t, eos, 1.0) for t, s in zip(seqs, scores)}
        both = [t for t in mine if t in rescored]
        matched += len(both)
        assert [mine[t] for t in both] == pytest.approx([rescored[t] for t in both], abs=1e-5)
        assert sorted(both, key=rescored.get, reverse=True) == both
    assert matched >= 4


def tinyserve_score(prompt_ids: list[int], completion, eos: int, length_penalty: float) -> float:
    """The package's beam_score of a sequence holding ``completion``'s tokens and cumulative logprob."""
    seq = Sequence(0, None, prompt_ids, 16)
    for token in completion.token_ids:
        seq.append_token_id(token)
    seq.cumulative_logprob = completion.cumulative_logprob
    return beam_score(seq, length_penalty, eos)


def beam_score_of(completion, prompt_len: int, eos: int, length_penalty: float) -> float:
    return v04_score(completion.cumulative_logprob, prompt_len, list(completion.token_ids), eos, length_penalty)


def test_smollm2_beams_are_transformers_beams(smollm2_loaded):
    """vLLM's own test shape (tests/samplers/test_beam_search.py): the real model, width 4, n 2,
    12 tokens, default length_penalty and early_stopping; no beam ends early on this prompt, so
    the two length definitions rank alike, and the scores are compared as cumulative logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = ModelConfig(model=str(smollm2_loaded.path), device="cpu", dtype="float32")
    engine = LLMEngine(config, CacheConfig(block_size=16, num_gpu_blocks=64, num_cpu_blocks=0),
                       SchedulerConfig(max_model_len=256),
                       executor=Worker(config, attention_backend="torch", loaded=smollm2_loaded))
    prompt = "A robot may not injure a human being or"
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0, max_tokens=12)
    engine.add_request("smol", prompt, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
    out = outs[0]
    assert out.finished and out.error is None
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_loaded.path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(smollm2_loaded.path))
    expected, scores = hf_beams(hf, tok, prompt, params)
    assert all(c.finish_reason == "length" for c in out.outputs)
    assert [list(c.token_ids) for c in out.outputs] == expected
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([s * 12 for s in scores], abs=1e-4)
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == 64


# -- 2. every policy and feature -------------------------------------------------------------------

SHARED = "Paging the KV cache into fixed-size blocks lets a server run many more requests at once. "
MIXED_PROMPTS = [SHARED + "Hello, my name is", SHARED + "The future of AI is", "The life is",
                 "What is the capital of France?", SHARED + "List three colors:"]
MIXED_PARAMS = [beams(4, 2, 14), beams(3, 3, 12, 1.0, True),
                SamplingParams(temperature=0.8, n=2, best_of=3, seed=7, max_tokens=10),
                SamplingParams(temperature=0, max_tokens=12), beams(4, 2, 14, 0.5, "never")]
BEAM_REQUESTS = {0, 1, 4}


def summary(out) -> list[tuple]:
    return [(tuple(c.token_ids), c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def alone(eos_models):
    """Each mixed request run alone on an ample cache: the reference."""
    llm = eos_models(0)[0]
    path = llm.engine.model_config.model
    ample = LLM(model=path, dtype="float32", block_size=4, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=1024,
                num_cpu_blocks=0)
    outs = [ample.generate([p], [sp])[0] for p, sp in zip(MIXED_PROMPTS, MIXED_PARAMS)]
    return path, outs


def watch_preemptions(scheduler) -> list[tuple[str, int, str]]:
    """Record each preemption: (request id, live sequences then, "swap", "recompute" or "given up")."""
    seen, preempt = [], scheduler._preempt

    def recording(group, out, budget):
        live = len(group.get_unfinished_seqs())
        preempt(group, out, budget)
        how = ("given up" if group.request_id not in out.preempted
               else "swap" if group.request_id in out.swapped_out else "recompute")
        seen.append((group.request_id, live, how))
    scheduler._preempt = recording
    return seen


SMALL = dict(num_gpu_blocks=36, num_cpu_blocks=64)
POLICY_CASES = {
    "vllm": dict(policy="vllm"),
    "orca": dict(policy="orca"),
    "v1": dict(policy="v1"),  # prefix caching and chunked prefill on, as V1 has them
    "vllm-prefix-caching": dict(policy="vllm", enable_prefix_caching=True),
    "orca-chunked": dict(policy="orca", enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=16),
    "vllm-swap": dict(policy="vllm", preemption_mode="swap", **SMALL),
    "vllm-recompute": dict(policy="vllm", preemption_mode="recompute", **SMALL),
    "vllm-default-mode": dict(policy="vllm", **SMALL),
    "orca-recompute-prefix": dict(policy="orca", preemption_mode="recompute", enable_prefix_caching=True, **SMALL),
    "v1-small": dict(policy="v1", max_num_batched_tokens=16, max_num_seqs=16, **SMALL),
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_beams_under_every_policy_equal_the_request_alone(alone, case):
    path, reference = alone
    settings = {"num_gpu_blocks": 1024, "num_cpu_blocks": 64, **POLICY_CASES[case]}
    llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=MAX_MODEL_LEN, **settings)
    engine = llm.engine
    seen = watch_preemptions(engine.scheduler)
    runs = 2 if engine.cache_config.enable_prefix_caching else 1  # the second run hits the first's blocks
    for run in range(runs):
        first_chunks = {}

        def note_chunks(engine, event, first_chunks=first_chunks):
            for s in event.scheduler_outputs.scheduled_seq_groups:
                first_chunks.setdefault(s.seq_group.request_id, s.token_chunk_size)
        engine.add_callback(note_chunks)
        outs = llm.generate(MIXED_PROMPTS, MIXED_PARAMS)
        engine.remove_callback(note_chunks)
        for i, (out, ref) in enumerate(zip(outs, reference)):
            assert out.error is None, out.error
            assert summary(out) == summary(ref), (case, i)
            assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
                [c.cumulative_logprob for c in ref.outputs], abs=1e-4)
        if run == 1:  # the shared prompts' blocks came from the cache
            hits = [i for i, o in enumerate(outs) if first_chunks[o.request_id] < len(o.prompt_token_ids)]
            assert BEAM_REQUESTS <= set(hits), hits
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == engine.cache_config.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == engine.cache_config.num_cpu_blocks
    assert bm.block_tables == {} and engine._groups == {}
    if "num_gpu_blocks" in POLICY_CASES[case]:
        assert engine.num_preemptions_total == len(seen) > 0
        # Recomputed only with one live sequence (a prompt, or the greedy request); several are swapped.
        forced_swap = POLICY_CASES[case].get("preemption_mode") == "swap"
        assert all((how == "recompute") == (live == 1 and not forced_swap) for _, live, how in seen), seen
    ways = {how for _, _, how in seen}
    if case == "vllm-recompute":  # forced recompute: beams still swapped, single sequences recomputed
        assert ways == {"swap", "recompute"}, seen
    if case == "vllm-swap":
        assert ways == {"swap"}, seen


def test_without_swap_space_a_beam_group_that_must_leave_is_given_up_alone(alone):
    """Two beam requests on a cache that holds one: the newer must leave, cannot be recomputed (it
    has several beams) nor swapped (no CPU blocks): it fails with a retryable error; the other is
    unchanged."""
    path, reference = alone
    llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=MAX_MODEL_LEN, num_gpu_blocks=36,
              num_cpu_blocks=0, preemption_mode="recompute")
    outs = llm.generate([MIXED_PROMPTS[0], MIXED_PROMPTS[4]], [MIXED_PARAMS[0], MIXED_PARAMS[4]])
    assert summary(outs[0]) == summary(reference[0]) and outs[0].error is None
    assert outs[1].error is not None and "cannot be recomputed" in outs[1].error and outs[1].retryable
    assert llm.engine.scheduler.block_manager.get_num_free_gpu_blocks() == 36


@pytest.mark.parametrize("policy,mode,in_prompt", [("orca", "recompute", PreemptionMode.RECOMPUTE),
                                                   ("v1", None, PreemptionMode.RECOMPUTE),
                                                   ("vllm", None, PreemptionMode.SWAP)])
def test_a_beam_group_is_recomputed_only_while_it_is_one_sequence(alone, policy, mode, in_prompt):
    """The decision itself (``_preemption_mode``): in its prompt, prefilled in pieces, a beam
    request is one sequence, recomputed under preemption_mode="recompute" and v1, but swapped
    under vLLM's default rule, which counts the sequences it will run (W, v0.4's
    ``get_max_num_running_seqs`` for beam search); once forked into beams it is swapped under
    every mode, even "recompute" and v1 (which otherwise only recomputes)."""
    path, _ = alone
    engine = small_engine(path, policy=policy, preemption_mode=mode, enable_chunked_prefill=True,
                          max_num_batched_tokens=16, max_num_seqs=16)
    engine.add_request("b", SHARED * 2, beams(4, 2, 6))
    engine.step()
    group = engine._groups["b"]
    assert group.get_seqs()[0].is_prefill() and len(group.get_unfinished_seqs()) == 1
    assert engine.scheduler._preemption_mode(group) == in_prompt
    while len(group.get_unfinished_seqs()) == 1:
        engine.step()
    assert len(group.get_unfinished_seqs()) == 4
    assert engine.scheduler._preemption_mode(group) == PreemptionMode.SWAP


# -- LLMEngine step by step ---------------------------------------------------------------------------

def small_engine(path, **settings) -> LLMEngine:
    return LLM(model=path, dtype="float32", block_size=4, max_model_len=MAX_MODEL_LEN,
               **{"num_gpu_blocks": 256, "num_cpu_blocks": 16, **settings}).engine


def test_aborting_a_beam_request_midway_frees_its_beams_and_leaves_the_other_unchanged(alone):
    path, reference = alone
    engine = small_engine(path)
    engine.add_request("beams", MIXED_PROMPTS[0], MIXED_PARAMS[0])
    engine.add_request("sampled", MIXED_PROMPTS[2], MIXED_PARAMS[2])
    outs = []
    for _ in range(4):
        outs += engine.step()
    group = engine._groups["beams"]
    seq_ids = [s.seq_id for s in group.get_seqs()]
    assert len(group.get_unfinished_seqs()) == 4  # four beams, forked from the prompt
    assert engine.has_unfinished_requests() and "sampled" in engine._groups
    engine.abort_request("beams")
    assert "beams" not in engine._groups
    assert not set(seq_ids) & set(engine.scheduler.block_manager.block_tables)
    after = []
    while engine.has_unfinished_requests():
        after += engine.step()
    assert {o.request_id for o in after} == {"sampled"}
    assert summary((outs + after)[-1]) == summary(reference[2])
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == 256 and bm.block_tables == {}


def test_aborting_a_swapped_out_beam_group_gives_its_cpu_blocks_back(alone):
    path, reference = alone
    engine = small_engine(path, num_gpu_blocks=36, num_cpu_blocks=64)
    engine.add_request("a", MIXED_PROMPTS[0], MIXED_PARAMS[0])
    engine.add_request("b", MIXED_PROMPTS[4], MIXED_PARAMS[4])
    outs = []
    while not engine.scheduler.swapped:
        outs += engine.step()
    assert [g.request_id for g in engine.scheduler.swapped] == ["b"]  # the newest, all its beams
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_cpu_blocks() < 64
    engine.abort_request("b")
    assert bm.get_num_free_cpu_blocks() == 64
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert summary([o for o in outs if o.finished][-1]) == summary(reference[0])
    assert bm.get_num_free_gpu_blocks() == 36 and bm.block_tables == {}


@pytest.mark.parametrize("kind", ["delta", "final_only", "cumulative"])
def test_output_kinds_with_beam_search(alone, kind):
    """Which beams are the n best is known only at the end: "delta" and "final_only" report
    nothing before it, then the whole beams (a delta from nothing); "cumulative" reports the n
    best beams so far at every step, by beam score, running and finished together."""
    path, reference = alone
    engine = small_engine(path)
    params = MIXED_PARAMS[1]
    engine.add_request("b", MIXED_PROMPTS[1], SamplingParams(**{**_fields(params), "output_kind": kind}))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    finals = [o for outs in steps for o in outs if o.finished]
    assert len(finals) == 1 and summary(finals[0]) == summary(reference[1])
    early = [o for outs in steps for o in outs if not o.finished]
    if kind == "cumulative":
        assert len(early) == len(steps) - 1
        eos = engine.eos_token_id
        for o in early:
            assert len(o.outputs) == params.n
            scores = [beam_score_of(c, len(o.prompt_token_ids), eos, params.length_penalty) for c in o.outputs]
            assert scores == sorted(scores, reverse=True)
    else:
        assert early == []


def _fields(params: SamplingParams) -> dict:
    from dataclasses import fields

    return {f.name: getattr(params, f.name) for f in fields(params)}


def test_widths_two_to_eight_fork_and_free_through_the_block_manager(eos_models):
    """Over widths 2..8 on the EOS-heavy model: never more than W beams live, every beam's blocks
    freed at the end (dropped beams too), whatever the width."""
    llm = eos_models(0)[0]
    engine = llm.engine
    free = engine.scheduler.block_manager.get_num_free_gpu_blocks()
    for width in range(2, 9):
        engine.add_request(f"w{width}", PROMPTS[2], beams(width, 2, 10, 1.0, "never"))
    most = {}
    while engine.has_unfinished_requests():
        engine.step()
        for rid, group in engine._groups.items():
            most[rid] = max(most.get(rid, 0), len(group.get_unfinished_seqs()))
    assert all(most[f"w{w}"] <= w for w in range(2, 9)), most
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == free
    assert engine.scheduler.block_manager.block_tables == {}

