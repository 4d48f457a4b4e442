"""vLLM v0.4's sampling features in the engine: logprobs and prompt logprobs against transformers'
``log_softmax`` on the same weights, the penalties and ``min_p`` against a direct implementation
written out here, ``min_tokens``, ``best_of``, ``include_stop_str_in_output``, compat's length
cap, and n > 1 / best_of with aborts and delta outputs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.sampler import Sampler, SampleRequest, apply_top_k_top_p
from tinyserve.sampling_params import SamplingParams
from tinyserve.sequence import Sequence
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "In a small village by the sea, an old man"]


def make_engine(loaded, *, compat="tinyserve", max_model_len=128, chunked=False, budget=None, num_gpu_blocks=128,
                max_num_seqs=16) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=4, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=64, watermark=0.0),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, compat=compat, enable_chunked_prefill=chunked),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


def run(engine: LLMEngine, requests: dict[str, tuple[str | list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        if isinstance(prompt, str):
            engine.add_request(rid, prompt, params)
        else:
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
    done = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert_no_leaks(engine)
    return done


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks and not bm.block_tables
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()


def hf_log_softmax(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities at every position of ``token_ids``: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_dict_matches(entry: dict[int, float], row: torch.Tensor, chosen: int, k: int) -> None:
    top = row.topk(k).indices.tolist()
    assert set(entry) == set(top) | {chosen}
    for token, value in entry.items():
        assert value == pytest.approx(float(row[token]), abs=2e-4)


# -- logprobs against transformers --------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(tiny_loaded, hf_model, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2, top_k=20 if temperature else -1)
    outs = run(make_engine(tiny_loaded), {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    for i in range(len(PROMPTS)):
        out = outs[f"r{i}"]
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        ref = hf_log_softmax(hf_model, ids)
        # The model's own log-probabilities, whatever the temperature and top-k the tokens were drawn with.
        assert len(c.logprobs) == len(c.token_ids) == 8
        for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert_dict_matches(entry, ref[len(out.prompt_token_ids) - 1 + j], token, 3)
        assert c.cumulative_logprob == pytest.approx(
            sum(float(ref[len(out.prompt_token_ids) - 1 + j, t]) for j, t in enumerate(c.token_ids)), abs=1e-3)
        prompt = out.prompt_token_ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            assert_dict_matches(out.prompt_logprobs[p], ref[p - 1], prompt[p], 2)


def test_prompt_logprobs_survive_chunked_prefill_and_mixed_batches(tiny_loaded):
    want = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = {"a": (PROMPTS[3], want), "b": (PROMPTS[0], plain), "c": (PROMPTS[1], want)}
    whole = run(make_engine(tiny_loaded), requests)
    chunked = run(make_engine(tiny_loaded, chunked=True, budget=5, max_num_seqs=4), requests)  # prompts in pieces
    for rid in requests:
        assert chunked[rid].outputs[0].token_ids == whole[rid].outputs[0].token_ids
        if rid == "b":
            assert whole[rid].prompt_logprobs is None and chunked[rid].prompt_logprobs is None
            continue
        assert len(chunked[rid].prompt_logprobs) == len(chunked[rid].prompt_token_ids)
        for x, y in zip(whole[rid].prompt_logprobs[1:], chunked[rid].prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_the_lm_head_runs_on_prompt_rows_only_for_requests_that_ask(tiny_loaded, monkeypatch):
    rows = []
    model = tiny_loaded.model
    compute = type(model).compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda hidden: rows.append(hidden.shape[0]) or compute(model, hidden))
    engine = make_engine(tiny_loaded)
    lens = [len(engine.tokenizer.encode(p)) for p in PROMPTS[:2]]
    run(engine, {"plain": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=2)),
                 "asks": (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))})
    assert rows[0] == 2 + lens[1] - 1  # one sampled row each, and the prompt rows of "asks" alone
    assert rows[1:] == [2]
    assert lens[0] > 2


# -- penalties, min_p and min_tokens against a direct implementation ----------------------------

def penalized_reference(logits: list[float], prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> list[float]:
    """OpenAI's and CTRL's definitions, token by token."""
    result = []
    for token, value in enumerate(logits):
        if token in prompt or token in output:
            value = value / repetition if value > 0 else value * repetition
        count = output.count(token)
        value -= frequency * count + presence * (count > 0)
        result.append(value)
    return result


def test_penalties_match_a_direct_implementation_on_random_logits():
    rng = random.Random(0)
    vocab, rows = 50, 12
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    requests, expected = [], []
    for i in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
        pp, fp = rng.choice([0.0, 0.5, -1.3, 2.0]), rng.choice([0.0, 0.7, -0.4])
        rp = rng.choice([1.0, 1.3, 0.6, 2.0]) if i else 1.0
        if i == 0:
            pp, fp = 0.0, 0.0  # a row without penalties is left alone
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), presence_penalty=pp, frequency_penalty=fp,
                                repetition_penalty=rp)
        requests.append(SampleRequest(params, prompt_token_ids=prompt, output_token_ids=output))
        expected.append(penalized_reference(logits[i].tolist(), prompt, output, pp, fp, rp))
    original = logits.clone()
    adjusted = Sampler._adjust(logits, requests)
    assert torch.equal(logits, original)  # the caller's logits are untouched
    assert torch.allclose(adjusted, torch.tensor(expected), atol=1e-5)
    assert torch.equal(adjusted[0], original[0])


def min_p_reference(row: list[float], params: SamplingParams) -> list[float]:
    """Softmax at the temperature in float64, drop below min_p x the top probability, renormalize."""
    scaled = [v / params.temperature for v in row]
    top = max(scaled)
    probs = [math.exp(v - top) for v in scaled]
    total = sum(probs)
    probs = [p / total for p in probs]
    kept = [p if p >= params.min_p * max(probs) else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


def test_min_p_matches_a_direct_implementation_on_random_logits():
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(temperature=t, min_p=m) for t, m in
              [(1.0, 0.0), (1.0, 0.05), (0.5, 0.3), (1.5, 0.9), (1.0, 1.0), (0.8, 0.2), (1.0, 0.5), (2.0, 0.1)]]
    probs = Sampler._probs(logits, params)
    for i, p in enumerate(params):
        expected = torch.tensor(min_p_reference(logits[i].tolist(), p), dtype=torch.float64)
        assert torch.allclose(probs[i].double(), expected, atol=1e-6)
    assert (probs[4] > 0).sum() == 1  # min_p = 1 keeps only the top token
    # After top-k the floor is still relative to the top token (renormalizing does not move it).
    row = logits[2:3]
    cut = apply_top_k_top_p(row.clone() / 0.5, torch.tensor([5]), torch.tensor([1.0]))
    both = Sampler._probs(row, [SamplingParams(temperature=0.5, top_k=5, min_p=0.3)])[0]
    alone = min_p_reference(cut[0].tolist(), SamplingParams(temperature=1.0, min_p=0.3))
    assert torch.allclose(both.double(), torch.tensor(alone, dtype=torch.float64), atol=1e-6)


def v04_apply_top_k_top_p():
    """v0.4.0's ``_apply_top_k_top_p``, compiled from the installed vllm's source (importing
    ``vllm`` would load its CUDA engine): the reference for chapter 9's "Compared with vLLM v0.4"."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    source = (Path(spec.submodule_search_locations[0]) / "model_executor" / "layers" / "sampler.py").read_text()
    tree = ast.parse(source)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_apply_top_k_top_p"]
    namespace = {"torch": torch}
    exec(compile(ast.Module([fn], type_ignores=[]), "vllm/model_executor/layers/sampler.py", "exec"), namespace)
    return namespace["_apply_top_k_top_p"]


def kept(masked: torch.Tensor) -> list[list[int]]:
    return [sorted(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in masked]


def test_top_k_with_top_p_differs_from_v04_as_chapter_9_says():
    v04 = v04_apply_top_k_top_p()
    # .40/.25/.20/.10/.05, k = 3, p = 0.7: v0.4 renormalizes the top 3 first (.47, .29, .24), so
    # .40 and .25 already pass 0.7; tinyserve measures the full distribution, where they make .65.
    logits = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05]]).log()
    k, p = torch.tensor([3]), torch.tensor([0.7])
    assert kept(v04(logits.clone(), p, k)) == [[0, 1]]
    assert kept(apply_top_k_top_p(logits.clone(), k, p)) == [[0, 1, 2]]
    # A tie with the k-th logit: v0.4 keeps every token equal to it, tinyserve exactly k.
    tied = torch.tensor([[3.0, 2.0, 1.0, 1.0, 1.0, 0.0]])
    assert len(kept(v04(tied.clone(), torch.tensor([1.0]), torch.tensor([3])))[0]) == 5
    assert len(kept(apply_top_k_top_p(tied.clone(), torch.tensor([3]), torch.tensor([1.0])))[0]) == 3
    # Without ties, and with only one of the two, they keep the same tokens.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)) * 2
    gen = torch.Generator().manual_seed(3)
    only_k = torch.randint(1, 50, (64,), generator=gen)
    only_p = torch.rand(64, generator=gen).clamp(0.05, 0.95)
    everything, nucleus = torch.full((64,), 50), torch.ones(64)
    assert kept(v04(logits.clone(), nucleus, only_k)) == kept(apply_top_k_top_p(logits.clone(), only_k, nucleus))
    assert kept(v04(logits.clone(), only_p, everything)) == kept(apply_top_k_top_p(logits.clone(), everything, only_p))


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(3, 10)
    logits[:, 7] = 50.0  # EOS would win
    logits[:, 3] = 40.0  # then the stop token
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    requests = [SampleRequest(params, output_token_ids=out, eos_token_id=7) for out in ([], [1], [1, 2])]
    assert Sampler()(logits, requests) == [[0], [0], [7]]


def test_min_tokens_in_the_engine_holds_back_stop_tokens_eos_and_stop_strings(tiny_loaded):
    engine = make_engine(tiny_loaded)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = run(engine, {"r": (PROMPTS[0], greedy)})["r"].outputs[0]
    stop_id = first.token_ids[1]
    stopped = run(engine, {"r": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                             stop_token_ids=[stop_id]))})["r"].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 2
    held = run(engine, {"r": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id],
                                                          min_tokens=6))})["r"].outputs[0]
    assert len(held.token_ids) >= 6 and stop_id not in held.token_ids[:6]
    # EOS too: make it the stop token's stand-in by asking for EOS = that token.
    engine.eos_token_id = stop_id
    eos_held = run(engine, {"r": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5))})["r"]
    assert len(eos_held.outputs[0].token_ids) >= 5 and stop_id not in eos_held.outputs[0].token_ids[:5]
    engine.eos_token_id = engine.tokenizer.eos_token_id
    # A stop string that completes before min_tokens does not stop the sequence.
    stop = first.text[:2]
    cut = run(engine, {"r": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                         stop=[stop]))})["r"].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == ""
    late = run(engine, {"r": (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                          min_tokens=12))})["r"].outputs[0]
    assert late.finish_reason == "length" and late.token_ids == first.token_ids


def test_repetition_penalty_matches_transformers_generate(tiny_loaded, hf_model):
    """transformers' RepetitionPenaltyLogitsProcessor has the same definition (prompt and output)."""
    engine = make_engine(tiny_loaded)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
    outs = run(engine, {f"r{i}": (p, params) for i, p in enumerate(PROMPTS)})
    plain = run(engine, {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
                         for i, p in enumerate(PROMPTS)})
    assert any(outs[r].outputs[0].token_ids != plain[r].outputs[0].token_ids for r in outs)  # it does something
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([engine.tokenizer.encode(p)])
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                    do_sample=False, repetition_penalty=1.8, pad_token_id=0)
        assert outs[f"r{i}"].outputs[0].token_ids == gen[0, ids.shape[1]:].tolist()


def test_presence_and_frequency_penalties_push_greedy_decoding_off_repeats(tiny_loaded):
    engine = make_engine(tiny_loaded)
    plain = run(engine, {"r": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))})
    pen = run(engine, {"r": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                         presence_penalty=2.0, frequency_penalty=2.0))})
    repeats = [len(o["r"].outputs[0].token_ids) - len(set(o["r"].outputs[0].token_ids)) for o in (plain, pen)]
    assert repeats[1] < repeats[0]


# -- best_of, n > 1, aborts and deltas ----------------------------------------------------------

def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(tiny_loaded):
    engine = make_engine(tiny_loaded)
    every = run(engine, {"r": (PROMPTS[1], SamplingParams(n=5, temperature=1.0, seed=11, max_tokens=6,
                                                           ignore_eos=True, logprobs=0))})["r"].outputs
    best = run(engine, {"r": (PROMPTS[1], SamplingParams(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=6,
                                                          ignore_eos=True))})["r"].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({tuple(c.token_ids) for c in every}) > 2  # the samples differ, so the choice matters
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]] and [c.index for c in best] == [0, 1]
    for c in every:
        assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)), abs=1e-9)


def test_best_of_and_n_with_delta_outputs_add_up_to_the_cumulative_run(tiny_loaded):
    for params in (dict(n=3), dict(n=2, best_of=4)):
        kw = dict(temperature=1.0, seed=5, max_tokens=7, ignore_eos=True, logprobs=1, **params)
        whole = run(make_engine(tiny_loaded), {"r": (PROMPTS[0], SamplingParams(**kw))})["r"]
        engine = make_engine(tiny_loaded)
        engine.add_request("r", PROMPTS[0], SamplingParams(output_kind="delta", **kw))
        pieces: dict[int, list] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    piece = pieces.setdefault(c.index, ["", [], []])
                    piece[0] += c.text
                    piece[1] += c.token_ids
                    piece[2] += c.logprobs
        assert [pieces[c.index][:2] for c in whole.outputs] == [[c.text, c.token_ids] for c in whole.outputs]
        assert all(pieces[c.index][2] == c.logprobs for c in whole.outputs)
        assert_no_leaks(engine)


def test_aborting_best_of_and_n_requests_frees_every_block(tiny_loaded):
    engine = make_engine(tiny_loaded, num_gpu_blocks=64, max_model_len=64)
    for i, kw in enumerate([dict(n=3), dict(n=1, best_of=4), dict(n=2, best_of=3)]):
        engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=1.0, seed=i, max_tokens=30,
                                                               ignore_eos=True, **kw))
    for _ in range(4):
        assert not any(o.finished for o in engine.step())
    assert sorted(len(g.get_seqs()) for g in engine.scheduler.running) == [3, 3, 4]  # best_of samples run
    engine.abort_request(["r0", "r1", "r2"])
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


def test_best_of_counts_against_max_num_seqs(tiny_loaded):
    engine = make_engine(tiny_loaded, max_num_seqs=3)
    out = run(engine, {"r": (PROMPTS[0], SamplingParams(n=1, best_of=4, temperature=1.0, max_tokens=3))})["r"]
    assert out.outputs[0].finish_reason == "ignored" and "best_of=4" in out.error


# -- include_stop_str_in_output -----------------------------------------------------------------

def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_what_follows(tiny_loaded):
    engine = make_engine(tiny_loaded)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = run(engine, {"r": (PROMPTS[1], greedy)})["r"].outputs[0].text
    stop = text[3:5]
    start = text.find(stop)
    for include, expected in ((False, text[:start]), (True, text[:start + len(stop)])):
        for kind in ("cumulative", "delta"):
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop, stop + "zzz"],
                                    include_stop_str_in_output=include, output_kind=kind)
            engine.add_request("r", PROMPTS[1], params)
            got = ""
            while engine.has_unfinished_requests():
                for out in engine.step():
                    got = got + out.outputs[0].text if kind == "delta" else out.outputs[0].text
                    reason = out.outputs[0].finish_reason
            assert (got, reason) == (expected, "stop"), (include, kind)


# -- compat="vllm-0.4": v0.4's length cap and its report of ignored prompts ---------------------

def test_compat_caps_at_more_than_max_model_len_and_before_the_stop_checks(tiny_loaded):
    ids = make_engine(tiny_loaded).tokenizer.encode(PROMPTS[0])
    greedy = run(make_engine(tiny_loaded), {"r": (ids, SamplingParams(temperature=0.0, max_tokens=8,
                                                                      ignore_eos=True))})["r"].outputs[0].token_ids
    lens = {}
    for compat in ("tinyserve", "vllm-0.4"):
        out = run(make_engine(tiny_loaded, compat=compat, max_model_len=len(ids) + 3),
                  {"r": (ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))})["r"].outputs[0]
        lens[compat] = (len(out.token_ids), out.finish_reason)
        assert out.token_ids == greedy[:len(out.token_ids)]
    assert lens == {"tinyserve": (3, "length"), "vllm-0.4": (4, "length")}
    # The token that reaches max_tokens is also a stop token: tinyserve says "stop", v0.4 "length".
    reasons = {}
    for compat in ("tinyserve", "vllm-0.4"):
        params = SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[greedy[2]])
        reasons[compat] = run(make_engine(tiny_loaded, compat=compat), {"r": (ids, params)})["r"].outputs[0]
    assert [reasons[c].finish_reason for c in reasons] == ["stop", "length"]
    assert reasons["tinyserve"].token_ids == reasons["vllm-0.4"].token_ids == greedy[:3]


def test_compat_reports_an_ignored_prompt_as_length(tiny_loaded):
    for compat, reason in (("tinyserve", "ignored"), ("vllm-0.4", "length")):
        engine = make_engine(tiny_loaded, compat=compat, max_model_len=8)
        out = run(engine, {"long": (list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=2)),
                           "ok": ([10, 11], SamplingParams(temperature=0.0, max_tokens=2))})
        assert out["long"].outputs[0].finish_reason == reason and out["long"].error
        assert out["ok"].outputs[0].finish_reason == "length" and len(out["ok"].outputs[0].token_ids) == 2


# -- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(best_of=1, n=2, temperature=1.0), "best_of"),
    (dict(best_of=0), "best_of"),
    (dict(best_of=2.0, temperature=1.0), "best_of"),
    (dict(best_of=3, temperature=0.0), "best_of"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=2.01), "repetition_penalty"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(seed=2**63 - 2, n=1, best_of=3, temperature=1.0), "seed"),
])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompt_logprobs_with_prefix_caching_skip_the_cache(tiny_loaded):
    # As vLLM V1: a request that asks for prompt logprobs takes no prefix hit, so every position
    # has its logits, and they equal those of an engine without the cache.
    def engine(prefix: bool) -> LLMEngine:
        mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
        return LLMEngine(mc, CacheConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=8,
                                         enable_prefix_caching=prefix),
                         SchedulerConfig(max_model_len=64), executor=Worker(mc, attention_backend="torch",
                                                                            loaded=tiny_loaded))

    params = SamplingParams(prompt_logprobs=1, max_tokens=2, temperature=0.0)

    def prompt_logprobs(e: LLMEngine, rid: str):
        e.add_request(rid, PROMPTS[0], params)
        while e.has_unfinished_requests():
            for out in e.step():
                if out.finished and out.request_id == rid:
                    return out.prompt_logprobs
        raise AssertionError(f"{rid} never finished")

    cached = engine(True)
    first = prompt_logprobs(cached, "a")
    again = prompt_logprobs(cached, "b")  # the prompt's blocks are in the cache now
    assert cached.scheduler.block_manager.num_cached_tokens(
        Sequence(0, None, cached.tokenizer.encode(PROMPTS[0]), 4)) > 0
    plain = prompt_logprobs(engine(False), "c")
    assert len(plain) == len(cached.tokenizer.encode(PROMPTS[0]))
    assert [list(p or {}) for p in again] == [list(p or {}) for p in plain] == [list(p or {}) for p in first]
    for a, b in zip(again[1:], plain[1:]):
        assert all(abs(a[t] - b[t]) < 1e-4 for t in b)
