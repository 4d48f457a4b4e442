"""Beam search (issue 37, in part): v0.4's semantics, against transformers' own beam search.

The oracle is ``generate(num_beams=W, num_return_sequences=n, do_sample=False)`` on the same
float32 weights (the tiny random Llama): the n returned beams must be the same token sequences,
and, with ``length_penalty=0`` (where both scores are the cumulative log-probability), the same
scores within 1e-4. With a length penalty the two define a beam's length differently (v0.4: the
whole sequence, prompt included and a final EOS not counted; transformers 5: the generated
tokens), so only the tokens are compared, on runs where no beam ends early (every beam then has
the same length at every step, and both rank them alike). The v0.4 checks of ``SamplingParams``
are tested here too, and the blocks: the beams share their prompt's blocks, and every block is
free once the request is done.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tinyserve import LLM, SamplingParams

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is"]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return LLM(model=str(tiny_model_dir), dtype="float32"), hf, AutoTokenizer.from_pretrained(str(tiny_model_dir))


def hf_beams(hf, tok, prompt: str, width: int, n: int, max_tokens: int, length_penalty: float, early_stopping):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, num_beams=width, num_return_sequences=n, do_sample=False, max_new_tokens=max_tokens,
                      length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
                      return_dict_in_generate=True, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    seqs = []
    for s in out.sequences:
        gen = s[ids.shape[1]:].tolist()
        if tok.eos_token_id in gen:  # transformers pads a beam that ended after its EOS
            gen = gen[:gen.index(tok.eos_token_id) + 1]
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("width,n,max_tokens,early_stopping",
                         [(2, 2, 6, False), (3, 2, 9, True), (4, 4, 5, "never"), (4, 1, 12, False), (6, 3, 7, True)])
def test_the_beams_are_transformers_beams(models, width, n, max_tokens, early_stopping):
    llm, hf, tok = models
    params = SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0, max_tokens=max_tokens,
                            length_penalty=0.0, early_stopping=early_stopping)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        expected, scores = hf_beams(hf, tok, prompt, width, n, max_tokens, 0.0, early_stopping)
        got = [list(c.token_ids) for c in out.outputs]
        assert got == expected, (prompt, got, expected)
        assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("length_penalty", [-1.0, 0.5, 1.0, 2.0])
def test_a_length_penalty_ranks_equal_length_beams_as_transformers_does(models, length_penalty):
    llm, hf, tok = models
    params = SamplingParams(use_beam_search=True, best_of=3, n=3, temperature=0, max_tokens=8,
                            length_penalty=length_penalty)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert all(c.finish_reason == "length" for c in out.outputs)  # no beam ended early
        expected, _ = hf_beams(hf, tok, prompt, 3, 3, 8, length_penalty, False)
        assert sorted(list(c.token_ids) for c in out.outputs) == sorted(expected)


def test_the_beams_share_the_prompt_and_give_every_block_back(models):
    llm, _, _ = models
    engine = llm.engine
    free = engine.scheduler.block_manager.get_num_free_gpu_blocks()
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, temperature=0, max_tokens=3)
    engine.add_request("beams", "The future of AI is " * 6, params)
    engine.step()  # the prompt: one sequence
    engine.step()  # four beams, forked from it
    group = engine._groups["beams"]
    tables = [engine.scheduler.block_manager.get_block_table(s) for s in group.get_unfinished_seqs()]
    assert len(tables) == 4
    assert all(t[:-1] == tables[0][:-1] for t in tables)  # every full prompt block is shared
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.block_manager.get_num_free_gpu_blocks() == free


@pytest.mark.parametrize("fields,message", [
    ({"best_of": 1}, "best_of must be greater than 1"),
    ({"best_of": 2, "temperature": 0.5}, "temperature must be 0"),
    ({"best_of": 2, "top_p": 0.9}, "top_p must be 1"),
    ({"best_of": 2, "top_k": 5}, "top_k must be -1"),
    ({"best_of": 2, "early_stopping": "sometimes"}, "early_stopping must be"),
    ({"best_of": 2, "presence_penalty": 0.5}, "does not combine beam search"),
])
def test_v04s_checks_of_beam_search(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(use_beam_search=True, temperature=fields.pop("temperature", 0), **fields)


@pytest.mark.parametrize("fields,message", [
    ({"early_stopping": True}, "early_stopping is not effective"),
    ({"length_penalty": 2.0}, "length_penalty is not effective"),
])
def test_beam_fields_without_beam_search_are_refused_as_v04_does(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_widths_and_n_over_a_grid_agree_with_transformers(models):
    llm, hf, tok = models
    cases = list(itertools.product([2, 3, 5], [1, 2], [4, 10]))
    for width, n, max_tokens in cases:
        params = SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0, max_tokens=max_tokens,
                                length_penalty=0.0)
        out = llm.generate(PROMPTS[1:2], params)[0]
        expected, _ = hf_beams(hf, tok, PROMPTS[1], width, n, max_tokens, 0.0, False)
        assert [list(c.token_ids) for c in out.outputs] == expected, (width, n, max_tokens)
