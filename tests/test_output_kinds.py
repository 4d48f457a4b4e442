"""What each step reports about a request, in the kind it asked for (``SamplingParams.output_kind``).

The reference is the cumulative kind, vLLM v0.4's only one: its last output is the request's
answer. Deltas must add up to exactly that answer, with nothing ever taken back (a stop string
that completes later is cut from the text, so text that might still become one is held back),
and must carry only what is new, never the whole token list again. ``final_only`` reports once.
"""

from __future__ import annotations

import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is"]


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=64, num_cpu_blocks=16),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))


def run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list]:
    """Every output of every request, step by step."""
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(params))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def with_kind(p: SamplingParams, kind: str) -> SamplingParams:
    return SamplingParams(**{**vars(p), "output_kind": kind})


def cases(engine: LLMEngine) -> list[SamplingParams]:
    """Greedy and seeded n=3 requests, and requests whose stop strings are cut from mid-text:
    each stop string is a piece of that request's own unconstrained answer."""
    base = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    free = run(engine, base)
    texts = [free[f"r{i}"][-1].outputs[0].text for i in range(len(base))]
    stops = []
    for text in texts:
        middle = text[len(text) // 3: len(text) // 3 + 3]
        assert len(middle) == 3 and middle.strip(), text  # a stop string that must be cut
        stops.append(middle)
    return base + [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stops[i], "\u00e9\u00e9"])
                   for i in (0, 2)]


def test_deltas_add_up_to_the_cumulative_answer_and_are_never_taken_back(engine):
    params = cases(engine)
    whole = run(engine, [with_kind(p, "cumulative") for p in params])
    deltas = run(engine, [with_kind(p, "delta") for p in params])
    for rid, outs in whole.items():
        final = outs[-1]
        assert final.finished and deltas[rid][-1].finished
        for c in final.outputs:
            pieces = [d for out in deltas[rid] for d in out.outputs if d.index == c.index]
            text = "".join(d.text for d in pieces)
            assert text == c.text and [t for d in pieces for t in d.token_ids] == c.token_ids
            so_far = ""
            for d in pieces:  # every prefix of the stream is a prefix of the answer
                so_far += d.text
                assert c.text.startswith(so_far)
            assert pieces[-1].finish_reason == c.finish_reason and all(d.finish_reason is None for d in pieces[:-1])
    assert any(o.outputs[0].finish_reason == "stop" for o in (whole["r3"][-1], whole["r4"][-1]))


def test_a_delta_carries_only_the_new_tokens(engine):
    deltas = run(engine, [SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=40, ignore_eos=True,
                                         output_kind="delta")])
    outs = deltas["r0"]
    assert len(outs) == 40  # one per step: the prefill's and 39 decodes'
    assert all(len(c.token_ids) == 1 for out in outs for c in out.outputs)


def test_final_only_reports_once_with_the_whole_answer(engine):
    params = cases(engine)
    whole = run(engine, [with_kind(p, "cumulative") for p in params])
    final = run(engine, [with_kind(p, "final_only") for p in params])
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished
        assert [(c.text, c.token_ids, c.finish_reason) for c in outs[0].outputs] == \
            [(c.text, c.token_ids, c.finish_reason) for c in whole[rid][-1].outputs]


def test_output_kind_is_checked_and_generate_refuses_deltas(engine):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="partial")
    llm = LLM.__new__(LLM)
    llm.engine, llm._counter = engine, iter(range(10**6))
    with pytest.raises(ValueError, match="output_kind='delta'"):
        llm.generate(PROMPTS[0], SamplingParams(output_kind="delta"))
    assert not engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, output_kind="final_only"))
    assert len(out[0].outputs[0].token_ids) == 5
