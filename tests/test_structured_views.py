"""Chapter 12's picture of structured output: ``lab.structured.MaskRecorder`` records what the
grammar allowed at each step, and ``viz.structured.draw_allowed_tokens`` draws it legibly.

The record is checked against independent references: the request's own output tokens, a fresh
matcher that replays them (what the grammar allowed before each), the count of tokens whose text
keeps the output a prefix of a choice, and the same run without the recorder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from tinyserve import LLM, SamplingParams  # noqa: E402
from tinyserve.grammar import GrammarCompiler  # noqa: E402
from tinyserve.guided_params import GuidedDecodingParams  # noqa: E402
from tinyserve.lab.structured import GuidedStep, MaskRecorder, mask_cost  # noqa: E402
from tinyserve.sampler import Sampler  # noqa: E402
from tinyserve.viz.structured import draw_allowed_tokens  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_figure_legibility import legibility_problems  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["red", "green", "blue sky"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    """Two guided requests run with the recorder and the same two without it."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, guided_decoding=GuidedDecodingParams(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=CHOICES))]
    prompts = ["Hello, my name is", "List three colors:"]
    recorder = MaskRecorder(Sampler(0))
    llm = LLM(model=str(tiny_model_dir), sampler=recorder, record_history=True)
    recorded = llm.generate(prompts, params)
    plain = LLM(model=str(tiny_model_dir)).generate(prompts, params)
    return llm, recorder, recorded, plain


def test_the_recorder_does_not_change_the_output(runs):
    _, _, recorded, plain = runs
    assert [o.outputs[0].token_ids for o in recorded] == [o.outputs[0].token_ids for o in plain]


def test_each_step_is_what_a_fresh_matcher_allows_before_the_token(runs):
    llm, recorder, recorded, _ = runs
    tok = llm.tokenizer
    compiler = GrammarCompiler(tok, llm.engine.vocab_size, tok.eos_token_id)
    assert len(recorder.steps) == 2  # one list per constrained sequence, in order of appearance
    for out, steps in zip(recorded, recorder.steps.values()):
        ids = out.outputs[0].token_ids
        assert [s.chosen for s in steps] == ids
        fresh = compiler.matcher(GuidedDecodingParams(json=SCHEMA) if out.request_id == recorded[0].request_id
                                 else GuidedDecodingParams(choice=CHOICES))
        for k, step in enumerate(steps):
            fresh.sync(ids[:k])
            allowed = fresh.allowed()
            assert step.num_allowed == int(allowed.sum())
            assert step.wanted_allowed == [bool(allowed[t]) for t in step.wanted]
            assert step.top_allowed[0] == step.chosen and all(allowed[t] for t in step.top_allowed)  # greedy
            assert step.fill_s > 0 and step.apply_s > 0


def test_the_first_choice_step_counts_the_tokens_that_start_a_choice(runs):
    llm, recorder, _, _ = runs
    tok = llm.tokenizer
    specials = set(tok.all_special_ids)
    starts = [t for t in range(llm.engine.vocab_size) if t not in specials
              and any(c.startswith(tok.decode([t])) for c in CHOICES)]
    assert len(starts) > 3
    assert list(recorder.steps.values())[1][0].num_allowed == len(starts)


def test_mask_cost_is_the_medians():
    steps = [GuidedStep(1, [0], [True], [0], 0, fill_s=f, apply_s=a) for f, a in ((1e-3, 2e-3), (3e-3, 4e-3),
                                                                                     (5e-3, 6e-3))]
    cost = mask_cost(steps, [0.1, 0.2, 0.4])
    assert cost == pytest.approx({"fill_ms": 3.0, "apply_ms": 4.0, "step_ms": 200.0, "share": 7.0 / 200.0})


@pytest.mark.parametrize("length", [3, 18, 40])
def test_the_drawing_is_legible(runs, length):
    llm, recorder, _, _ = runs
    steps = (list(recorder.steps.values())[0] * 40)[:length]
    steps[0] = GuidedStep(1, [5, 6], [False, True], [6], 6)  # one masked favourite at least
    fig = draw_allowed_tokens(steps, llm.tokenizer, llm.engine.vocab_size, title="allowed tokens")
    try:
        assert legibility_problems(fig) == []
        assert len(fig.axes[0].patches) == length  # one bar per step
    finally:
        plt.close(fig)
