"""A bounded soak of the server on loopback: 64 and more concurrent requests of every kind at once.

Completions and chats, streamed and not, greedy and seeded, n up to 3, clients that hang up
mid-answer and requests that are invalid in every way the server knows, all sent together to
a real uvicorn server on a free loopback port, over a KV cache small enough that the scheduler
must preempt. Every answer that completes must equal offline ``LLM.generate`` on the same engine
(computed before the server starts), every invalid request must get its 4xx, no request may
wait past a bound, and afterwards ``/metrics`` must read an idle engine and no block may be held.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:",
           "In a small village by the sea,", "Paging the KV cache", "0123456789 The quick brown fox"]
QUESTIONS = ["What is the capital of France?", "List three colors.", "Answer briefly: why page a cache?"]
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 12
NUM_GPU_BLOCKS = 32
BOUND_S = 60.0  # no request may take longer than this, start to last byte


def valid_specs(rng: random.Random, count: int) -> list[dict]:
    """Requests whose answers are reproducible: greedy, or sampled with a seed."""
    specs = []
    for i in range(count):
        temperature = rng.choice([0.0, 0.8, 1.0])
        n = rng.choice([1, 2, 3]) if temperature else 1
        fields = {"max_tokens": rng.randint(8, 32) if n == 1 else rng.randint(4, 16), "temperature": temperature,
                  "ignore_eos": rng.random() < 0.7}
        if temperature:
            fields |= {"seed": rng.randrange(2**32), "n": n, "top_p": rng.choice([1.0, 0.9]),
                       "top_k": rng.choice([-1, 20])}
        chat = i % 3 == 2
        if chat:
            messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
            if rng.random() < 0.5:
                messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
            body = {"model": "tiny", "messages": messages, **fields}
        else:
            body = {"model": "tiny", "prompt": rng.choice(PROMPTS), **fields}
        specs.append({"kind": "valid", "chat": chat, "stream": rng.random() < 0.5, "body": body})
    return specs


def invalid_specs(limits) -> list[dict]:
    """(body or raw bytes, path, method, expected status) for requests the server must refuse."""
    text = {"model": "tiny", "prompt": "x", "max_tokens": 4}
    chat = {"model": "tiny", "max_tokens": 4}
    cases = [
        ("/v1/completions", {**text, "temperature": 1e-38}, 400),
        ("/v1/completions", {**text, "top_k": 9223372036854775808}, 400),
        ("/v1/completions", {**text, "n": 2, "seed": 18446744073709551615}, 400),
        ("/v1/completions", {**text, "n": MAX_NUM_SEQS + 1, "temperature": 1}, 400),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": NaN}', 400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}, 400),
        ("/v1/completions", {**text, "model": "gpt-4"}, 404),
        ("/v1/completions", {**text, "prompt": "a" * (limits.max_prompt_chars + 1)}, 400),
        ("/v1/completions", {**text, "prompt": "a" * limits.max_body_bytes}, 413),
        ("/v1/nothing", {}, 404),
        ("/v1/completions", None, 405),  # a GET
        # Lone surrogates, deep nesting, loose types, unknown message fields, too many messages.
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 4}', 400),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400),
        ("/v1/completions", b"[" * 100_000, 400),
        ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 100_000, 400),
        ("/v1/completions", {**text, "max_tokens": "4"}, 400),
        ("/v1/completions", {**text, "max_tokens": True}, 400),
        ("/v1/completions", {**text, "temperature": "0.5"}, 400),
        ("/v1/completions", {**text, "prompt": [True, False]}, 400),
        ("/v1/completions", {**text, "stream": True, "stream_options": {"include_usage": "no"}}, 400),
        ("/v1/completions", {**text, "logprobs": 6}, 400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x", "name": 5}]}, 400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": ""}] * 2000}, 400),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
         400),
    ]
    return [{"kind": "invalid", "path": p, "body": b, "status": s} for p, b, s in cases]


def disconnect_specs(rng: random.Random, count: int) -> list[dict]:
    return [{"kind": "disconnect", "stream": i % 2 == 0,
             "body": {"model": "tiny", "prompt": rng.choice(PROMPTS), "max_tokens": 100, "temperature": 0,
                      "ignore_eos": True}} for i in range(count)]


@pytest.fixture(scope="module")
def soak(tiny_loaded):
    """(engine, server, specs with their offline answers)."""
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    llm = LLM.__new__(LLM)  # reuse the session's loaded model rather than loading it again
    # 32 blocks of 8 tokens for up to 12 sequences: the scheduler has to preempt (and swap).
    llm.engine = LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=32),
                           SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN),
                           executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))
    llm._counter = iter(range(10**6))
    rng = random.Random(12)
    valid = valid_specs(rng, 40)
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template(s["body"]["messages"], tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False) if s["chat"] else tok.encode(s["body"]["prompt"]) for s in valid]
    params = [SamplingParams(**{k: v for k, v in s["body"].items() if k not in ("model", "prompt", "messages")})
              for s in valid]
    for p, n in zip(params, ids):  # each one fits alone: only the crowd makes the cache short
        assert p.n * -(-(len(n) + p.max_tokens) // 8) <= NUM_GPU_BLOCKS
    for spec, out in zip(valid, llm.generate(prompt_token_ids=ids, sampling_params=params)):
        spec["expected"] = [(c.text, c.finish_reason) for c in out.outputs]
    server = ServerThread(create_app(llm.engine, model_name="tiny")).start()
    limits = server.server.config.app.state.limits
    specs = valid + disconnect_specs(rng, 12) + invalid_specs(limits)
    rng.shuffle(specs)
    try:
        yield llm.engine, server, specs
    finally:
        server.stop()


def choices_of_stream(lines: list[str], chat: bool) -> tuple[dict, dict, list]:
    """(text per choice, finish_reason per choice, error events) of a server-sent event stream."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    texts, reasons, errors = {}, {}, []
    for e in map(json.loads, events[:-1]):
        if "error" in e:
            errors.append(e)
        for c in e.get("choices", []):
            piece = c["delta"].get("content", "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    return texts, reasons, errors


async def run_one(client: httpx.AsyncClient, spec: dict) -> dict:
    t0 = time.monotonic()
    result: dict = {}
    if spec["kind"] == "invalid":
        if spec["body"] is None:
            r = await client.get(spec["path"])
        elif isinstance(spec["body"], bytes):
            r = await client.post(spec["path"], content=spec["body"], headers={"content-type": "application/json"})
        else:
            r = await client.post(spec["path"], json=spec["body"])
        result = {"status": r.status_code, "json": r.json()}
    elif spec["kind"] == "disconnect":
        if spec["stream"]:
            async with client.stream("POST", "/v1/completions", json={**spec["body"], "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # hang up after the first chunk
        else:
            try:
                await asyncio.wait_for(client.post("/v1/completions", json=spec["body"]), 0.3)
            except asyncio.TimeoutError:
                pass  # gave up waiting: the connection is closed under the request
    else:
        path = "/v1/chat/completions" if spec["chat"] else "/v1/completions"
        if spec["stream"]:
            async with client.stream("POST", path, json={**spec["body"], "stream": True}) as r:
                result["status"] = r.status_code
                lines = [line async for line in r.aiter_lines()]
            texts, reasons, errors = choices_of_stream(lines, spec["chat"])
            result["got"] = [(texts.get(i, ""), reasons.get(i)) for i in sorted(texts)]
            result["errors"] = errors
        else:
            r = await client.post(path, json=spec["body"])
            result["status"] = r.status_code
            body = r.json()
            result["got"] = [(c["message"]["content"] if spec["chat"] else c["text"], c["finish_reason"])
                             for c in sorted(body["choices"], key=lambda c: c["index"])]
            result["errors"] = []
            result["completion_tokens"] = body["usage"]["completion_tokens"]
    result["seconds"] = time.monotonic() - t0
    return result


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_64_concurrent_requests_of_every_kind(soak):
    engine, server, specs = soak
    assert len(specs) >= 64
    before = scrape(server.url)

    async def main():
        limits = httpx.Limits(max_connections=len(specs), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=BOUND_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(run_one(client, s) for s in specs)), BOUND_S + 20)

    t0 = time.monotonic()
    results = asyncio.run(main())
    elapsed = time.monotonic() - t0

    for spec, res in zip(specs, results):
        assert res["seconds"] < BOUND_S, spec
        if spec["kind"] == "invalid":
            assert res["status"] == spec["status"], (spec["path"], res)
            assert res["json"]["error"]["message"], res
        elif spec["kind"] == "valid":
            assert res["status"] == 200 and res["errors"] == [], (spec, res)
            assert res["got"] == spec["expected"], spec
    # The engine is idle again: nothing running, waiting or swapped, and no block in use.
    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        time.sleep(0.05)
    time.sleep(0.2)  # the loop takes its snapshot after the step that finished the last one
    after = scrape(server.url)
    for gauge in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "gpu_cache_usage_perc",
                  "cpu_cache_usage_perc"]:
        assert after[f"tinyserve:{gauge}"] == 0, gauge
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks and not bm.block_tables
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    # The counters moved: every token of every complete answer was counted, and the small cache preempted.
    complete = sum(r.get("completion_tokens", 0) for r in results)
    assert after["tinyserve:generation_tokens_total"] - before["tinyserve:generation_tokens_total"] >= complete > 0
    assert after["tinyserve:num_preemptions_total"] > before["tinyserve:num_preemptions_total"]
    print(f"soak: {len(specs)} requests in {elapsed:.1f} s, "
          f"{after['tinyserve:num_preemptions_total'] - before['tinyserve:num_preemptions_total']:.0f} preemptions")
