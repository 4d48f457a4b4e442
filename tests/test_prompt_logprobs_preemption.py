"""``prompt_logprobs`` survive preemption (issue 36, N3): a chunked prefill preempted by recompute
starts over from position 0, so its chunks no longer begin where the collected logprobs end;
the engine must skip the positions it already has and take the rest. Compared here against
the same requests run with room for all of them (no preemption, no chunking), under every
policy, by recompute and by swap, with prefix caching on and off, offline through the engine
and through ``LLM.generate``, and over HTTP as completions' ``echo`` with ``logprobs``."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sampling_params import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

# Three prompts that fill a 20-block cache (block size 4) while the later ones are still being
# prefilled in chunks of 16: the first one's decodes then preempt the others mid-prefill.
LENGTHS = (34, 12, 30)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
# Every combination the package allows: v1 preempts by recompute only.
CASES = [(policy, mode, prefix) for policy in ("vllm", "orca", "v1")
         for mode in (("recompute",) if policy == "v1" else ("recompute", "swap")) for prefix in (False, True)]


@pytest.fixture(scope="module")
def prompts(tiny_loaded) -> list[list[int]]:
    rng = random.Random(0)
    vocab = tiny_loaded.hf_config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def make_engine(loaded, *, policy="vllm", mode=None, prefix=False, blocks=20, budget=16,
                chunked=True) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=4, num_gpu_blocks=blocks, num_cpu_blocks=64, watermark=0.0,
                                     enable_prefix_caching=prefix),
                     SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, max_model_len=80,
                                     policy=policy, preemption_mode=mode, enable_chunked_prefill=chunked),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


def watch_preemptions(engine: LLMEngine) -> list[tuple[str, str, int]]:
    """A list that fills with every preemption of a prompt still being prefilled: (request id,
    "recompute" or "swap", prompt logprobs collected when it left)."""
    left = []

    def watch(eng, event):
        out = event.scheduler_outputs
        for kind, ids in (("recompute", out.preempted), ("swap", out.swapped_out)):
            for rid in ids:
                group = eng._groups[rid]
                if kind == "recompute" and rid in out.swapped_out:
                    continue  # counted as a swap
                collected = len(group.prompt_logprobs)
                if collected < len(group.prompt_token_ids):
                    left.append((rid, kind, collected))

    engine.add_callback(watch)
    return left


def run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict, list[tuple[str, str, int]]]:
    """The finished outputs by request id, and the preemptions mid-prefill (``watch_preemptions``)."""
    left = watch_preemptions(engine)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, PARAMS, prompt_token_ids=ids)
    done = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in engine.step() if o.finished}
    bm = engine.scheduler.block_manager
    assert not engine.has_unfinished_requests() and not bm.block_tables
    return done, left


@pytest.fixture(scope="module")
def reference(tiny_loaded, prompts) -> dict:
    """Room for every request at once and whole prompts: no preemption, no chunk."""
    done, left = run(make_engine(tiny_loaded, blocks=128, budget=256, chunked=False), prompts)
    assert left == []
    return done


def assert_same_prompt_logprobs(got, want) -> None:
    assert got.prompt_logprobs is not None, f"{got.request_id}: prompt_logprobs lost"
    assert len(got.prompt_logprobs) == len(want.prompt_logprobs) == len(want.prompt_token_ids)
    assert got.prompt_logprobs[0] is None
    for p, (x, y) in enumerate(zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]), start=1):
        assert x.keys() == y.keys(), f"{got.request_id} position {p}"
        assert all(abs(x[t] - y[t]) < 1e-4 for t in y), f"{got.request_id} position {p}"


@pytest.mark.parametrize("policy,mode,prefix", CASES)
def test_prompt_logprobs_equal_a_run_without_preemption(tiny_loaded, prompts, reference, policy, mode, prefix):
    done, left = run(make_engine(tiny_loaded, policy=policy, mode=mode, prefix=prefix), prompts)
    # The case under test happened: a prompt left mid-prefill with some logprobs collected.
    assert any(kind == mode and collected > 1 for _, kind, collected in left), left
    assert done.keys() == reference.keys()
    for rid, want in reference.items():
        assert done[rid].outputs[0].token_ids == want.outputs[0].token_ids
        assert_same_prompt_logprobs(done[rid], want)


def test_prompt_logprobs_through_llm_generate_survive_recompute(tiny_model_dir, prompts, reference):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=20,
              num_cpu_blocks=64, watermark=0.0, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=80,
              policy="v1", attention_backend="torch")
    preempted = []
    llm.engine.add_callback(lambda eng, event: preempted.extend(event.scheduler_outputs.preempted))
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS)
    assert preempted
    for out, want in zip(outs, reference.values()):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert_same_prompt_logprobs(out, want)


def test_a_gap_in_the_collected_positions_fails_that_request_alone(tiny_loaded, prompts, reference):
    # No schedule makes a gap today; should one appear (say, a prefix-cache hit), the request
    # must fail by name rather than answer with misplaced or missing prompt logprobs.
    engine = make_engine(tiny_loaded, blocks=128, budget=16)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", None, PARAMS, prompt_token_ids=ids)
    done: dict = {}
    while not done:  # r0's first chunk of 16 positions
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if len(engine._groups["r0"].prompt_logprobs) > 1:
            break
    del engine._groups["r0"].prompt_logprobs[1:]  # drop what the first chunk collected
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert "prompt logprobs are missing from position 0" in done["r0"].error
    for rid in ("r1", "r2"):
        assert done[rid].error is None
        assert_same_prompt_logprobs(done[rid], reference[rid])
    assert not engine.scheduler.block_manager.block_tables


def test_echo_over_http_survives_recompute(tiny_loaded, prompts, reference):
    engine = make_engine(tiny_loaded, policy="v1")
    left = watch_preemptions(engine)
    # The engine holds its first step until the three requests are in, so they run in the order
    # sent, as offline: the same schedule, the same preemption.
    step, opened = engine.step, []

    def gated_step():
        if not opened and engine.get_num_unfinished_requests() < len(prompts):
            time.sleep(0.005)
            return []
        opened.append(True)
        return step()

    engine.step = gated_step
    server = ServerThread(create_app(engine, model_name="tiny")).start()

    def complete(ids: list[int]) -> dict:
        body = {"model": "tiny", "prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "echo": True, "logprobs": 2}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = []
            for i, ids in enumerate(prompts):
                futures.append(pool.submit(complete, ids))
                deadline = time.monotonic() + 30
                while engine.get_num_unfinished_requests() <= i and time.monotonic() < deadline:
                    time.sleep(0.005)
            bodies = [f.result() for f in futures]
    finally:
        server.stop()
    assert any(kind == "recompute" and collected > 1 for _, kind, collected in left), left
    for ids, body, want in zip(prompts, bodies, reference.values()):
        lp = body["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 24
        assert lp["token_logprobs"][0] is None  # nothing predicts the first prompt token
        expected = [entry[t] for t, entry in zip(ids[1:], want.prompt_logprobs[1:])]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
        assert all(len(top) >= 2 for top in lp["top_logprobs"][1:len(ids)])
