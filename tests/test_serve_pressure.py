"""Memory pressure through the server (issue 21): whose fault a refusal is, and what it says.

With no CPU swap space, a request for several samples cannot be preempted by swapping; it once
got a 400 "request_cannot_fit" naming the server's block counts whenever long single-sample
requests filled the cache, though alone it runs. Now a single-sample request is recomputed in
its place. When the engine really must give a request up for memory (only multi-sample groups
are running), that is the server's failure: a retryable 503 with OpenAI's ``server_error`` body,
and the server's settings go to the log, not to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is"]
SETTINGS_WORDS = ("block", "swap", "num_gpu", "num_cpu", "max_num_seqs", "watermark")


def engine_with(tiny_loaded, gpu: int) -> LLMEngine:
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=gpu, num_cpu_blocks=0),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))


async def stream_text(client: httpx.AsyncClient, body: dict, started: asyncio.Event) -> str:
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        text = []
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                started.set()
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)


def test_two_samples_with_no_swap_space_are_served_while_long_requests_fill_the_cache(tiny_loaded):
    engine = engine_with(tiny_loaded, gpu=44)  # the long answers' 3 x 14 blocks fit, the pair's 18 more do not
    llm = LLM.__new__(LLM)
    llm.engine, llm._counter = engine, iter(range(10**6))
    greedy = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    pair = {"model": "tiny", "prompt": "List three colors:", "n": 2, "temperature": 1.0, "seed": 5,
            "max_tokens": 60, "ignore_eos": True}
    before = engine.num_preemptions_total

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started = [asyncio.Event() for _ in PROMPTS]
            longs = [asyncio.create_task(stream_text(client, {"model": "tiny", "prompt": p, "max_tokens": 100,
                                                              "temperature": 0, "ignore_eos": True}, e))
                     for p, e in zip(PROMPTS, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
            r = await client.post("/v1/completions", json=pair)
            return r, await asyncio.wait_for(asyncio.gather(*longs), 60)

    with ServerThread(create_app(engine, model_name="tiny")) as server:
        r, texts = asyncio.run(main())
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 120
    assert texts == offline  # recomputed, the long requests' greedy answers are unchanged
    assert engine.num_preemptions_total > before  # the cache did run short


def test_a_request_given_up_for_memory_gets_a_retryable_503_without_the_servers_settings(tiny_loaded, caplog):
    engine = engine_with(tiny_loaded, gpu=24)  # each pair may need 18 blocks: one fits, two do not
    body = {"model": "tiny", "prompt": "Once upon a time", "n": 2, "temperature": 1.0, "max_tokens": 60,
            "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "seed": i}) for i in range(2)))

    with caplog.at_level(logging.WARNING, logger="tinyserve.serve"), \
            ServerThread(create_app(engine, model_name="tiny")) as server:
        responses = asyncio.run(main())
        after = httpx.post(f"{server.url}/v1/completions", json={**body, "seed": 9}, timeout=60)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 503], [r.text for r in responses]
    error = next(r for r in responses if r.status_code == 503).json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_overloaded"
    assert "retry" in error["message"].lower()
    assert not any(w in error["message"].lower() for w in SETTINGS_WORDS), error["message"]
    assert any("CPU swap space is full" in rec.getMessage() for rec in caplog.records)  # the operator's reason
    assert after.status_code == 200  # alone, the same request is served


@pytest.fixture
def never_fits_engine(tiny_loaded):
    return engine_with(tiny_loaded, gpu=16)


def test_a_request_that_can_never_fit_is_told_what_to_lower_not_the_servers_sizes(never_fits_engine, caplog):
    huge = {"model": "tiny", "prompt": "Hi", "n": 4, "temperature": 1.0, "max_tokens": 100, "seed": 0}
    with caplog.at_level(logging.WARNING, logger="tinyserve.serve"), \
            ServerThread(create_app(never_fits_engine, model_name="tiny")) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=huge, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "request_cannot_fit" and "max_tokens" in error["message"] and " n" in error["message"]
    assert not any(w in error["message"].lower() for w in SETTINGS_WORDS), error["message"]
    assert any("16 blocks of 8 tokens" in rec.getMessage() for rec in caplog.records)
