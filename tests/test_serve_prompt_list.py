"""A list of prompts in one ``/v1/completions`` request (issue 36, item 1), as OpenAI and vLLM take
it: strings or lists of token ids; choice ``i * n + j`` is prompt i's sample j; usage summed;
streamed too; every limit counts every prompt.

The independent reference: the same prompts sent one request each (greedy, so the tokens must
be the same), and the tokenizer's own encoding of each prompt for the token counts.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The capital of France", "One two three four five"]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def served(tiny_loaded):
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    engine = LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=96, num_cpu_blocks=16),
                       SchedulerConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN),
                       executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded), record_history=True)
    with ServerThread(create_app(engine, model_name="tiny")) as server:
        server.engine = engine
        yield server


def wait_until_idle_and_free(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        time.sleep(0.05)
    time.sleep(0.1)  # the loop may be finishing the step that noticed
    bm = engine.scheduler.block_manager
    assert not bm.block_tables and bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


def post(server: ServerThread, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.post("/v1/completions", json=body)


def completion(prompt, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: ServerThread, body: dict) -> list[dict]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_list_of_prompts_gives_each_prompt_the_tokens_of_its_own_request(served):
    singles = [ok(post(served, completion(p, logprobs=1))) for p in PROMPTS]
    together = ok(post(served, completion(PROMPTS, logprobs=1)))
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    for single, choice in zip(singles, together["choices"]):
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert together["usage"][key] == sum(s["usage"][key] for s in singles)


def test_token_id_prompts_and_their_lengths(served):
    tokenizer = served.server.config.app.state.tokenizer
    ids = [tokenizer.encode(p) for p in PROMPTS]
    by_text = ok(post(served, completion(PROMPTS)))
    by_ids = ok(post(served, completion(ids)))
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    assert by_ids["usage"]["prompt_tokens"] == sum(map(len, ids)) == by_text["usage"]["prompt_tokens"]


def test_choices_are_indexed_prompt_by_prompt_then_sample_by_sample(served):
    n = 2
    together = ok(post(served, completion(PROMPTS, n=n, temperature=1.0, seed=5)))
    assert sorted(c["index"] for c in together["choices"]) == list(range(len(PROMPTS) * n))
    # Seeded: prompt i's samples are those of its own request with the same seed.
    for i, p in enumerate(PROMPTS):
        single = ok(post(served, completion(p, n=n, temperature=1.0, seed=5)))
        mine = {c["index"] - i * n: c["text"] for c in together["choices"] if c["index"] // n == i}
        assert mine == {c["index"]: c["text"] for c in single["choices"]}
    assert together["usage"]["completion_tokens"] == len(PROMPTS) * n * 8


def test_a_streamed_list_matches_the_plain_answer(served):
    plain = ok(post(served, completion(PROMPTS, echo=True)))
    chunks = stream(served, completion(PROMPTS, echo=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk["id"] == chunks[0]["id"]
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert all(texts[i].startswith(p) for i, p in enumerate(PROMPTS))  # echoed, each its own prompt
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_every_prompt_is_checked_and_named(served):
    too_long = list(range(1, MAX_MODEL_LEN + 1))
    r = post(served, completion([[1, 2, 3], too_long]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = post(served, completion([PROMPTS[0], "x" * 10**5]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1"
    r = post(served, completion([[1, 2], []]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # max_tokens counts against each prompt's own length.
    r = post(served, completion([[1] * 10, [1] * 100], max_tokens=MAX_MODEL_LEN - 50))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert ok(post(served, completion(PROMPTS)))  # the server goes on


def test_a_client_that_leaves_has_every_prompt_aborted(served):
    engine = served.engine
    body = completion(PROMPTS, max_tokens=100)
    start = len(engine.history)
    with httpx.Client(base_url=served.url, timeout=60) as client:  # a stream left midway
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_until_idle_and_free(engine)
    assert len(engine.history) - start < 100  # aborted, not run to the end
    start = len(engine.history)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:  # a plain answer given up
        payload = json.dumps(body).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 20
        while len(engine.history) - start < 3:  # wait until it is decoding
            assert time.monotonic() < deadline
            time.sleep(0.02)
    wait_until_idle_and_free(engine)
    assert len(engine.history) - start < 100


def test_scoring_a_list_as_lm_eval_does_matches_one_prompt_at_a_time(served):
    # lm-eval's loglikelihood requests: token ids, echo, max_tokens=0, logprobs=1, batched.
    tokenizer = served.server.config.app.state.tokenizer
    ids = [tokenizer.encode(p) for p in PROMPTS]
    body = {"echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    singles = [ok(post(served, {"model": "tiny", "prompt": i, **body}))["choices"][0] for i in ids]
    together = ok(post(served, {"model": "tiny", "prompt": ids, **body}))
    assert together["usage"]["completion_tokens"] == 0
    for single, choice in zip(singles, together["choices"]):
        assert choice["logprobs"]["tokens"] == single["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(single["logprobs"]["token_logprobs"][1:],
                                                                         abs=1e-5)
