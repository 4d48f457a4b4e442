"""The engine end to end: parity with transformers, scheduling never changes greedy output,
sampling, parallel sampling with copy-on-write, bad input, and the demo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tinyserve import presets, sim
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sequence import SamplingParams, Sequence
from tinyserve.worker import Worker

PROMPTS = [
    "Hello, my name is",
    "The future of AI is",
    "The life is",
    "In a small village by the sea, an old fisherman",
    "List three colors:",
    "Paging the KV cache into fixed-size blocks lets a server",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def make_engine(loaded, *, block_size=16, num_gpu_blocks=256, num_cpu_blocks=64, policy="vllm",
                preemption_mode=None, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=None,
                backend="torch", watermark=0.01, seed=0, record_history=False,
                enable_prefix_caching=None) -> LLMEngine:
    worker = Worker(ModelConfig(model=str(loaded.path), device="cpu", dtype="float32", seed=seed),
                    attention_backend=backend, loaded=loaded)
    return LLMEngine(
        ModelConfig(model=str(loaded.path), device="cpu", dtype="float32", seed=seed),
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                    watermark=watermark,
                    # As LLM defaults it: on under policy="v1", as vLLM V1 has it.
                    enable_prefix_caching=policy == "v1" if enable_prefix_caching is None else enable_prefix_caching),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, policy=policy, preemption_mode=preemption_mode),
        executor=worker, record_history=record_history,
    )


def run_all(engine: LLMEngine, prompts, params, arrivals=None) -> dict[str, list[int]]:
    """Run to completion; ``arrivals[i]`` is the step before which prompt i is added."""
    arrivals = arrivals or [0] * len(prompts)
    results: dict[str, list[int]] = {}
    step = 0
    while len(results) < len(prompts):
        for i, p in enumerate(prompts):
            if arrivals[i] == step:
                engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 2000, "the engine made no progress"
    return {f"r{i}": results[f"r{i}"] for i in range(len(prompts))}


def assert_no_leaks(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not bm.block_tables
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)


def hf_greedy(model_dir, prompts, max_new_tokens) -> list[list[int]]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


# -- parity with transformers -----------------------------------------------------------------

def test_greedy_matches_transformers_generate_on_a_tiny_model(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_loaded)
    ours = run_all(engine, PROMPTS, GREEDY)
    theirs = hf_greedy(tiny_model_dir, PROMPTS, GREEDY.max_tokens)
    assert list(ours.values()) == theirs
    assert_no_leaks(engine)


@pytest.mark.slow
def test_default_model_matches_transformers_generate_on_the_seed_prompts(smollm2_loaded):
    prompts = list(presets.SEED_PROMPTS.values())
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine = make_engine(smollm2_loaded)
    ours = run_all(engine, prompts, params)
    theirs = hf_greedy(smollm2_loaded.path, prompts, 16)
    assert list(ours.values()) == theirs
    assert all(len(t) == 16 for t in theirs)


# -- scheduling never changes greedy output ---------------------------------------------------

@pytest.fixture(scope="module")
def unconstrained(tiny_loaded):
    return run_all(make_engine(tiny_loaded), PROMPTS, GREEDY)


@pytest.mark.parametrize(("policy", "mode"), [("vllm", "recompute"), ("vllm", "swap"), ("orca", "recompute"),
                                              ("orca", "swap"), ("v1", "recompute")])
def test_tiny_block_pool_preempts_without_changing_output(tiny_loaded, unconstrained, policy, mode):
    # 7 blocks of 8 tokens for six sequences that each grow to 25-33 tokens: constant preemption.
    engine = make_engine(tiny_loaded, block_size=8, num_gpu_blocks=7, num_cpu_blocks=32, policy=policy,
                         preemption_mode=mode, max_model_len=56, watermark=0.0, record_history=True)
    assert run_all(engine, PROMPTS, GREEDY) == unconstrained
    assert any(r.preempted for r in engine.history), "the tiny pool should force preemptions"
    # The running totals the server's /metrics reads agree with the recorded rounds.
    assert engine.num_preemptions_total == sum(len(r.preempted) for r in engine.history)
    assert engine.num_generation_tokens_total == sum(map(len, unconstrained.values()))
    if mode == "swap":
        assert any(r.swapped_out for r in engine.history) and any(r.swapped_in for r in engine.history)
    assert_no_leaks(engine)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_size_does_not_change_output(tiny_loaded, unconstrained, block_size):
    engine = make_engine(tiny_loaded, block_size=block_size, num_gpu_blocks=4096 // block_size)
    assert run_all(engine, PROMPTS, GREEDY) == unconstrained
    assert_no_leaks(engine)


@pytest.mark.parametrize("policy", ["vllm", "orca", "v1"])
def test_requests_arriving_mid_run_get_the_same_tokens(tiny_loaded, unconstrained, policy):
    engine = make_engine(tiny_loaded, policy=policy, num_gpu_blocks=12, block_size=8, max_model_len=96,
                         preemption_mode=None if policy == "v1" else "swap", watermark=0.0, record_history=True)
    assert run_all(engine, PROMPTS, GREEDY, arrivals=[0, 0, 3, 5, 5, 9]) == unconstrained
    if policy != "vllm":
        assert any(r.phase == "mixed" for r in engine.history)
    assert_no_leaks(engine)


def test_triton_backend_gives_the_same_greedy_tokens(tiny_loaded, unconstrained):
    engine = make_engine(tiny_loaded, backend="triton")
    try:
        assert run_all(engine, PROMPTS[:3], GREEDY) == {k: unconstrained[k] for k in ("r0", "r1", "r2")}
    finally:
        engine.executor.model.set_attention_backend("torch")


# -- sampling ---------------------------------------------------------------------------------

def test_a_seeded_request_gives_the_same_tokens_whatever_shares_its_batch(tiny_loaded):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_loaded)
    alone.add_request("x", PROMPTS[0], seeded)
    crowded = make_engine(tiny_loaded, seed=99)
    for i, p in enumerate(PROMPTS[1:]):
        crowded.add_request(f"other{i}", p, SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True))
    crowded.add_request("x", PROMPTS[0], seeded)

    def tokens_of(engine):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "x" and out.finished:
                    return out.outputs[0].token_ids
        raise AssertionError("x never finished")

    a, b = tokens_of(alone), tokens_of(crowded)
    assert a == b and len(a) == 12
    # And the seed matters: another seed gives another stream.
    other = make_engine(tiny_loaded)
    other.add_request("x", PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=4321,
                                                      ignore_eos=True))
    assert tokens_of(other) != a


def test_parallel_sampling_shares_prompt_blocks_until_the_samples_diverge(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=8)
    # 10-token prompt: block 0 full, block 1 holds 2 tokens, the one the samples will write into.
    prompt_ids = list(range(100, 110))
    engine.add_request("n2", None, SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=7, ignore_eos=True),
                       prompt_token_ids=prompt_ids)
    engine.step()  # prefill, then two samples: the group forks
    bm = engine.scheduler.block_manager
    group = engine._groups["n2"]
    a, b = group.get_seqs()
    assert bm.get_block_table(a) == bm.get_block_table(b)
    assert all(blk.ref_count == 2 for blk in bm.block_tables[a.seq_id])
    metas, out = engine.scheduler.schedule()  # the first decode must copy the shared last block
    assert len(out.blocks_to_copy) == 1
    src, dsts = next(iter(out.blocks_to_copy.items()))
    ta, tb = bm.get_block_table(a), bm.get_block_table(b)
    assert ta[0] == tb[0] and bm.block_tables[a.seq_id][0].ref_count == 2  # the full block is still shared
    assert {ta[1], tb[1]} == {src, dsts[0]}
    engine.abort_request("n2")
    assert_no_leaks(engine)


def test_n2_finishes_two_samples_and_frees_everything(tiny_loaded):
    engine = make_engine(tiny_loaded)
    engine.add_request("n2", PROMPTS[3], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=3,
                                                        ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.finished and len(final.outputs) == 2
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in final.outputs)
    assert final.outputs[0].token_ids != final.outputs[1].token_ids
    assert_no_leaks(engine)


def test_stop_strings_and_stop_token_ids(tiny_loaded, unconstrained):
    engine = make_engine(tiny_loaded)
    reference = unconstrained["r0"]
    stop_id = reference[5]
    first = reference.index(stop_id)
    engine.add_request("tok", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))
    text = engine.tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    engine.add_request("str", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, stop=stop))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0]
    assert outs["tok"].token_ids == reference[: first + 1] and outs["tok"].finish_reason == "stop"
    assert outs["str"].finish_reason == "stop" and stop not in outs["str"].text
    assert text.startswith(outs["str"].text) and len(outs["str"].text) <= text.index(stop)
    assert_no_leaks(engine)


def test_the_stop_string_that_starts_first_wins_when_two_complete_in_one_step(tiny_loaded, unconstrained):
    # Find a step whose new text completes two stop strings at once: B straddles the old text
    # and the new piece, A lies inside the new piece (after B's start). Listed as [A, B], the
    # text must still be cut where B starts.
    from tinyserve.detokenizer import detokenize_incrementally

    def two_stops_in_one_step():
        for rid, ids in unconstrained.items():
            seq = Sequence(0, None, [1], block_size=16)
            for k, t in enumerate(ids):
                before = seq.output_text
                seq.append_token_id(t)
                piece = detokenize_incrementally(tiny_loaded.tokenizer, seq)
                text, n = seq.output_text, len(before)
                if n and len(piece) >= 2 and text.find(text[n - 1:n + 1]) == n - 1 and text.find(piece[1:]) == n + 1:
                    return rid, ids[:k + 1], piece[1:], text[n - 1:n + 1], before[:n - 1]
        raise AssertionError("no step of the reference outputs completes two stop strings at once")

    rid, ids, a, b, expected = two_stops_in_one_step()
    engine = make_engine(tiny_loaded)
    engine.add_request(rid, PROMPTS[int(rid[1:])], SamplingParams(temperature=0, max_tokens=20, stop=[a, b]))
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    c = out.outputs[0]
    assert (c.text, c.finish_reason) == (expected, "stop")
    assert c.token_ids == ids


def test_a_request_whose_own_step_fails_is_aborted_while_the_others_finish(tiny_loaded, unconstrained, monkeypatch):
    import tinyserve.engine as engine_module

    engine = make_engine(tiny_loaded)
    overflowing = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=5)
    sampler = engine.sampler

    def sample(logits, requests):  # as if this request's logits overflowed (float16, say)
        logits = logits.clone()
        for i, r in enumerate(requests):
            if r.params is overflowing:
                logits[i] = float("inf")
        return sampler(logits, requests)

    undecodable = tiny_loaded.tokenizer.encode(PROMPTS[4])
    detokenize = engine_module.detokenize_incrementally

    def detokenize_or_fail(tokenizer, seq):  # a tokenizer that chokes on this request's third token
        if seq.prompt_token_ids == undecodable and seq.get_output_len() == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return detokenize(tokenizer, seq)

    engine.sampler = sample
    monkeypatch.setattr(engine_module, "detokenize_incrementally", detokenize_or_fail)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    engine.add_request("nan", PROMPTS[3], overflowing)
    engine.add_request("text", None, GREEDY, prompt_token_ids=undecodable)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    assert {rid: outs[rid].outputs[0].token_ids for rid in ("r0", "r1", "r2")} == \
           {rid: unconstrained[rid] for rid in ("r0", "r1", "r2")}
    assert outs["nan"].outputs[0].finish_reason == "abort" and outs["nan"].outputs[0].token_ids == []
    assert "'nan'" in outs["nan"].error and "not finite" in outs["nan"].error
    assert outs["text"].outputs[0].finish_reason == "abort" and len(outs["text"].outputs[0].token_ids) == 3
    assert "detokenization failed" in outs["text"].error
    assert_no_leaks(engine)
    assert not engine._groups and not engine._generators


# -- observers ------------------------------------------------------------------------------------

def test_callbacks_hear_every_step_and_history_is_kept_only_when_asked(tiny_loaded):
    engine = make_engine(tiny_loaded)
    with pytest.raises(RuntimeError, match="record_history=True"):
        _ = engine.history
    events = []
    engine.add_callback(lambda eng, event: events.append(event))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], GREEDY)
    final = {}
    while engine.has_unfinished_requests():
        final |= {o.request_id: o for o in engine.step() if o.finished}
    produced: dict[tuple[str, int], list[int]] = {}
    for event in events:
        for group, seq, token in event.produced:
            produced.setdefault((group.request_id, group.get_seqs().index(seq)), []).append(token)
    assert produced == {(rid, c.index): c.token_ids for rid, out in final.items() for c in out.outputs}
    assert sorted(rid for e in events for rid in e.finished) == ["a", "b"]
    assert [e.outputs for e in events][-1][0].finished
    assert engine.num_generation_tokens_total == 2 * 5 + 20
    assert engine.times.history == [] and engine.times.model > 0  # totals only, no per-step list


def test_the_engine_core_loads_neither_the_simulator_nor_the_recorder():
    code = ("import sys, tinyserve.engine; print([m for m in sys.modules "
            "if m in ('tinyserve.sim', 'tinyserve.recording') or m.startswith('tinyserve.viz')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- bad input ----------------------------------------------------------------------------------

def test_an_over_long_prompt_is_ignored_with_a_message_while_the_others_finish(tiny_loaded, unconstrained):
    engine = make_engine(tiny_loaded, max_model_len=64, max_num_batched_tokens=64)
    long_prompt = " ".join(["word"] * 100)
    engine.add_request("long", long_prompt, GREEDY)
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", p, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert outs["long"].outputs[0].finish_reason == "ignored"
    assert "longer than" in outs["long"].error and "64" in outs["long"].error
    assert outs["r0"].outputs[0].token_ids == unconstrained["r0"]
    assert outs["r1"].outputs[0].token_ids == unconstrained["r1"]
    assert_no_leaks(engine)


def test_generate_rejects_bad_input_and_loses_nothing(tiny_loaded, tiny_model_dir):
    llm = LLM.__new__(LLM)  # reuse the loaded tiny model instead of loading it again
    llm.engine = make_engine(tiny_loaded)
    llm._counter = iter(range(10**6))
    with pytest.raises(ValueError, match="empty list"):
        llm.generate([], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY)
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate(["a", "b"], [GREEDY] * 3)
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["a"], SamplingParams(top_p=1.5))
    assert not llm.engine.has_unfinished_requests()  # the good prompt of a bad batch was withdrawn
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"]
    assert_no_leaks(llm.engine)


def test_abort_mid_run_frees_everything(tiny_loaded):
    engine = make_engine(tiny_loaded, block_size=8, num_gpu_blocks=7, num_cpu_blocks=32,
                         preemption_mode="swap", max_model_len=56, watermark=0.0)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(8):
        engine.step()
    assert engine.scheduler.swapped or engine.scheduler.waiting
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


def test_duplicate_request_ids_are_refused(tiny_loaded):
    engine = make_engine(tiny_loaded)
    engine.add_request("a", "hi", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "again", GREEDY)


# -- the demo -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("policy", "mode"), [("vllm", "swap"), ("vllm", "recompute"), ("v1", None)])
def test_demo_prints_the_rounds_the_scheduler_records(policy, mode, capsys, smollm2_loaded, monkeypatch):
    import tinyserve.__main__ as demo

    # Reuse the session's loaded model rather than loading it a second time.
    monkeypatch.setattr(demo, "LLMEngine", lambda mc, cc, sc, **kw: LLMEngine(
        mc, cc, sc, executor=Worker(mc, loaded=smollm2_loaded), record_history=kw["record_history"]))
    args = ["--policy", policy, "--device", "cpu"] + (["--preemption-mode", mode] if mode else [])
    engine, outs = demo.run(demo.parser().parse_args(args))
    printed = capsys.readouterr().out
    preset = presets.seed_rounds(mode or "auto", policy=policy)
    expected = sim.simulate(preset.requests, preset.scheduler_config, preset.cache_config)
    assert [(r.batch, r.preempted, r.waiting, r.running, r.swapped, r.block_tables) for r in engine.history] == \
           [(r.batch, r.preempted, r.waiting, r.running, r.swapped, r.block_tables) for r in expected]
    # Every round is told, identical quiet ones together ("rounds 4–7: decode s0 s1 (×4)").
    for group in demo.group_rounds(expected):
        first, last = group[0].round, group[-1].round
        label = f"round {first}:" if first == last else f"rounds {first}–{last}:"
        assert any(line.startswith(label) and " ".join(group[0].batch) in line for line in printed.splitlines())
    assert printed.count("PREEMPTED") == sum(len(r.preempted) for r in expected)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert "Completions:" in printed
