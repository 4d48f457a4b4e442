"""The OpenAI-compatible server, over real HTTP on a free loopback port.

One server (uvicorn in a background thread) serves the tiny random Llama for the whole module.
Offline ``LLM.generate`` on the same engine, before the server starts, gives the texts every
streamed answer must add up to. Every loop here is bounded and the server is always stopped.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from cli_serving import free_port, wait_until_serving

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.llm import LLM
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
LONG = 100  # tokens of a stream that is still running while other requests come and go
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def served(tiny_loaded):
    """(llm, server, offline completions of PROMPTS, offline chat answer).

    ``llm.offline_long`` holds the offline texts of PROMPTS[:3] with LONG greedy tokens."""
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    llm = LLM.__new__(LLM)  # reuse the session's loaded model rather than loading it again
    llm.engine = LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=96, num_cpu_blocks=16),
                           SchedulerConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN),
                           executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded), record_history=True)
    llm._counter = iter(range(10**6))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False)
    chat = llm.generate(prompt_token_ids=[chat_ids], sampling_params=greedy)[0].outputs[0].text
    llm.offline_long = [o.outputs[0].text for o in llm.generate(
        PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True))]
    server = ServerThread(create_app(llm.engine, model_name="tiny")).start()
    try:
        yield llm, server, offline, chat
    finally:
        server.stop()


def completion(prompt, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent event stream, checking it ends with [DONE]."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def wait_until_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        time.sleep(0.05)
    time.sleep(0.1)  # the loop may be finishing the step that noticed


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.scheduler.block_manager
    assert not bm.block_tables
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks)


def test_health_and_models(served):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=10) as client:
        assert client.get("/health").status_code == 200
        models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_a_completion_matches_offline_generate(served):
    llm, server, offline, _ = served
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = client.post("/v1/completions", json=completion(PROMPTS[0])).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["text"] == offline[0] and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(PROMPTS[0]))


def test_concurrent_streams_all_complete_with_the_offline_text(served):
    llm, server, offline, chat = served
    start = len(llm.engine.history)

    async def stream(client: httpx.AsyncClient, url: str, body: dict) -> list:
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            return sse_events([line async for line in r.aiter_lines()])

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            jobs = [stream(client, "/v1/completions", completion(p)) for p in PROMPTS]
            jobs.append(stream(client, "/v1/chat/completions", {"model": "tiny", "messages": CHAT,
                                                                 "max_tokens": MAX_TOKENS, "temperature": 0,
                                                                 "ignore_eos": True}))
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

    *completions, chat_events = asyncio.run(main())
    for events, expected in zip(completions, offline):
        assert all(e["object"] == "text_completion" for e in events)
        assert "".join(e["choices"][0]["text"] for e in events) == expected
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert chat_events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in chat_events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat_events) == chat
    # The requests were batched together: some round ran several of them at once.
    assert max(len(r.batch) for r in llm.engine.history[start:]) >= 2
    wait_until_idle(llm.engine)
    assert_all_blocks_free(llm.engine)


def test_a_client_that_disconnects_mid_stream_leaves_no_blocks_allocated(served):
    llm, server, _, _ = served
    start = len(llm.engine.history)
    body = completion(PROMPTS[1], max_tokens=100, stream=True)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it is generating
        # Leaving the block closed the connection mid-stream.
    wait_until_idle(llm.engine)
    assert_all_blocks_free(llm.engine)
    assert len(llm.engine.history) - start < 100  # aborted, not run to the end


def test_a_client_that_gives_up_on_a_plain_request_leaves_no_blocks_allocated(served):
    llm, server, _, _ = served
    start = len(llm.engine.history)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        payload = json.dumps(completion(PROMPTS[2], max_tokens=100)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        deadline = time.monotonic() + 20
        while len(llm.engine.history) - start < 3:  # wait until it is decoding
            assert time.monotonic() < deadline
            time.sleep(0.02)
    wait_until_idle(llm.engine)
    assert_all_blocks_free(llm.engine)
    assert len(llm.engine.history) - start < 100


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "tiny"}).encode(), "prompt"),
    (json.dumps(completion("x", temperature=-1)).encode(), "temperature"),
    (json.dumps(completion("x", top_p=0)).encode(), "top_p"),
    (json.dumps(completion("x", max_tokens=0)).encode(), "max_tokens"),
    (json.dumps(completion("x", max_tokens="many")).encode(), "max_tokens"),
    (json.dumps(completion("x", n=2)).encode(), "n"),  # n > 1 with greedy decoding
    (json.dumps(completion("x", stream="yes")).encode(), "stream"),
    (json.dumps(completion("x", frequency_penalty=2.5)).encode(), "frequency_penalty"),  # outside [-2, 2]
    (json.dumps(completion("x", temprature=0.5)).encode(), "temprature"),  # a typo is not ignored
    (json.dumps(completion([10**9])).encode(), "prompt"),
    (json.dumps(completion([["a"], ["b"]])).encode(), "prompt"),  # a list of prompts is served (issue 36)
])
def test_bad_requests_get_a_400_with_an_openai_error_body(served, body, param):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_bad_chat_requests_and_an_unknown_model(served):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages.0.role")
        r = client.post("/v1/completions", json=completion("x", model="gpt-4"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_over_long_prompts_get_a_clear_error(served):
    llm, server, _, _ = served
    long_prompt = " ".join(["word"] * 400)
    assert len(llm.tokenizer.encode(long_prompt)) > MAX_MODEL_LEN
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/completions", json=completion(long_prompt))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in err["message"]
        # A short prompt whose completion would not fit is refused the same way.
        r = client.post("/v1/completions", json=completion("Hi", max_tokens=MAX_MODEL_LEN))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": long_prompt}]})
        assert r.status_code == 400 and "context length" in r.json()["error"]["message"]
    assert_all_blocks_free(llm.engine)


def test_the_openai_client_works_against_the_server(served):
    import openai  # requirements-dev.txt: the test must run, never skip
    _, server, offline, chat = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == ["tiny"]
    extra = {"ignore_eos": True}
    out = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body=extra)
    assert out.choices[0].text == offline[3] and out.usage.completion_tokens == MAX_TOKENS
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra)
    assert reply.choices[0].message.content == chat and reply.choices[0].message.role == "assistant"
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body=extra)]
    assert "".join(pieces) == chat
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=5)


def test_stop_strings_are_never_streamed(served):
    _, server, offline, _ = served
    text = offline[0]
    # Two characters from the middle of the text, neither a half-decoded one.
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    with httpx.Client(base_url=server.url, timeout=60) as client:
        plain = client.post("/v1/completions", json=completion(PROMPTS[0], stop=[stop])).json()
        with client.stream("POST", "/v1/completions", json=completion(PROMPTS[0], stop=[stop], stream=True)) as r:
            events = sse_events(list(r.iter_lines()))
    assert plain["choices"][0]["text"] == text[: text.index(stop)]
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["text"] for e in events) == text[: text.index(stop)]


def test_python_dash_m_tinyserve_serve_starts_answers_and_stops(tiny_model_dir):
    from tinyserve.serve import parser

    assert parser().parse_args([]).host == "127.0.0.1"  # loopback unless told otherwise
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve.serve", "--host", "127.0.0.1", "--port", str(port),
                             "--model", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "128",
                             "--num-gpu-blocks", "32", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, port, proc.stdout.read)
        name = tiny_model_dir.name  # served under its directory's name
        body = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": name, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}).json()
        assert body["model"] == name and body["choices"][0]["finish_reason"] in ("length", "stop")
        proc.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn shuts down cleanly
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# -- issue 12: hostile input is refused at the boundary, and never hurts the other requests ----

def error_of(r: httpx.Response, status: int = 400) -> dict:
    """The OpenAI error body of a response that must have this status."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "server_error")
    return error


async def stream_text(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> tuple:
    """(text of choice 0, finish reasons, error events) of a streamed completion."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = []
        async for line in r.aiter_lines():
            lines.append(line)
            if started is not None and line.startswith("data: "):
                started.set()
    events = sse_events(lines)
    chunks = [e for e in events if "choices" in e]
    reasons = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    return "".join(e["choices"][0]["text"] for e in chunks), reasons, [e for e in events if "error" in e]


HOSTILE = [  # each once made the shared engine step raise and failed every stream in flight
    ({"temperature": 1e-38}, "temperature"),
    ({"top_k": 9223372036854775808}, "top_k"),
    ({"n": 2, "seed": 18446744073709551615, "temperature": 1}, "seed"),
]


def test_hostile_sampling_values_get_a_400_while_three_streams_finish_normally(served):
    llm, server, _, _ = served

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.ensure_future(stream_text(client, completion(p, max_tokens=LONG), ev))
                       for p, ev in zip(PROMPTS[:3], started)]
            await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 30)
            bad = await asyncio.gather(*(client.post("/v1/completions", json=completion("x", **fields))
                                         for fields, _ in HOSTILE))
            running = [not s.done() for s in streams]
            return bad, running, await asyncio.wait_for(asyncio.gather(*streams), 60)

    bad, running, streamed = asyncio.run(main())
    for r, (_, param) in zip(bad, HOSTILE):
        assert error_of(r)["param"] == param
    assert any(running)  # the bad requests did arrive while the streams were going
    for (text, reasons, errors), expected in zip(streamed, llm.offline_long):
        assert (text, reasons, errors) == (expected, ["length"], [])
    wait_until_idle(llm.engine)
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 1e-6}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": 10**6}, "top_k"),  # beyond the vocabulary
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"n": 2, "temperature": 1, "seed": 2**63 - 1}, "seed"),  # the second sample's seed would overflow
    ({"n": 9, "temperature": 1}, "n"),  # more sequences than the server runs at once (max_num_seqs=8)
    ({"n": 17, "temperature": 1}, "n"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"stop": ""}, "stop.0"),
    ({"stop": ["x" * 257]}, "stop.0"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"presence_penalty": 1e300}, "presence_penalty"),
])
def test_every_sampling_field_has_a_range(served, fields, param):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert error_of(client.post("/v1/completions", json=completion("x", **fields)))["param"] == param
        # The chat endpoint shares the fields and their checks.
        chat = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "temperature": 0, **fields}
        assert error_of(client.post("/v1/chat/completions", json=chat))["param"] == param


@pytest.mark.parametrize("raw,param", [('"temperature": NaN', "temperature"), ('"top_p": Infinity', "top_p"),
                                       ('"temperature": -Infinity', "temperature")])
def test_nan_and_infinity_are_refused(served, raw, param):
    _, server, _, _ = served
    body = '{"model": "tiny", "prompt": "x", ' + raw + "}"  # Python's json reads these; JSON has no such numbers
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert error_of(r)["param"] == param


def test_values_at_the_edge_of_each_range_are_served(served):
    llm, server, offline, _ = served
    vocab = llm.engine.executor.loaded.hf_config.vocab_size
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for fields in [{"temperature": 1e-5, "seed": 0}, {"top_k": vocab, "temperature": 0.7, "seed": 1},
                       {"n": 2, "temperature": 1, "seed": 2**63 - 2}, {"n": 8, "temperature": 1, "seed": 5},
                       {"stop_token_ids": [vocab - 1], "temperature": 0}]:
            r = client.post("/v1/completions", json=completion(PROMPTS[0], **fields))
            assert r.status_code == 200, (fields, r.text)
            assert [c["index"] for c in r.json()["choices"]] == list(range(fields.get("n", 1)))
        # Greedy at the temperature floor is still a sample, but a near-deterministic one.
        r = client.post("/v1/completions", json=completion(PROMPTS[0], temperature=1e-5, seed=3)).json()
    assert r["choices"][0]["text"] == offline[0]


def test_sampling_params_errors_become_400s_naming_the_field(served):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        # Checked by SamplingParams itself (greedy samples would be identical), not by pydantic.
        assert error_of(client.post("/v1/completions", json=completion("x", n=2)))["param"] == "n"


def test_a_step_that_fails_for_one_request_fails_only_that_request(served, monkeypatch):
    """The engine finishes the request it can blame with an error (finish_reason "abort"); here
    that request is picked by its prompt, three tokens in, and the others must finish untouched."""
    llm, server, _, _ = served
    engine, real_check = llm.engine, llm.engine._check_stop
    victim = llm.tokenizer.encode(PROMPTS[3])

    def check_stop(group, seq):  # the engine's per-request processing fails on the victim only
        if group.prompt_token_ids == victim and seq.get_output_len() >= 3:
            raise RuntimeError("sampling failed for this request")
        real_check(group, seq)

    monkeypatch.setattr(engine, "_check_stop", check_stop)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            streams = [stream_text(client, completion(p, max_tokens=LONG)) for p in PROMPTS[:3]]
            plain = client.post("/v1/completions", json=completion(PROMPTS[3], max_tokens=LONG))
            streamed_victim = stream_text(client, completion(PROMPTS[3], max_tokens=LONG))
            return await asyncio.wait_for(asyncio.gather(plain, streamed_victim, *streams), 60)

    plain, (_, reasons, errors), *streamed = asyncio.run(main())
    assert "sampling failed" in error_of(plain, 500)["message"]
    assert reasons == ["abort"] and len(errors) == 1 and "sampling failed" in errors[0]["error"]["message"]
    for (text, reasons, errors), expected in zip(streamed, llm.offline_long):
        assert (text, reasons, errors) == (expected, ["length"], [])
    monkeypatch.undo()
    wait_until_idle(llm.engine)
    assert_all_blocks_free(llm.engine)


def test_a_step_that_fails_for_no_known_request_fails_those_in_flight_and_the_server_goes_on(served, monkeypatch):
    llm, server, offline, _ = served
    engine, real_step = llm.engine, llm.engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device fell over")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json=completion(PROMPTS[0], max_tokens=LONG))
        assert "the device fell over" in error_of(r, 500)["message"]
        assert not engine.has_unfinished_requests()
        assert_all_blocks_free(engine)
        # The loop is still serving: the next request completes as if nothing had happened.
        r = client.post("/v1/completions", json=completion(PROMPTS[0]))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline[0]
        assert "tinyserve:num_requests_running 0.0" in client.get("/metrics").text
    assert len(calls) > 3


# -- issue 12, item 6: a huge prompt never stalls the streams -------------------------------------

def test_a_10_mb_prompt_is_refused_quickly_while_a_stream_runs_undisturbed(served):
    llm, server, _, _ = served
    limits = server.server.config.app.state.limits
    huge = "word " * 2_000_000  # 10 MB: tokenizing it takes the tiny tokenizer about 15 s

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started = asyncio.Event()
            stream = asyncio.ensure_future(stream_text(client, completion(PROMPTS[0], max_tokens=LONG), started))
            await asyncio.wait_for(started.wait(), 30)
            t0 = time.monotonic()
            r = await client.post("/v1/completions", json=completion(huge))
            return r, time.monotonic() - t0, await asyncio.wait_for(stream, 60)

    r, seconds, (text, reasons, _) = asyncio.run(main())
    error = error_of(r, 413)
    assert str(limits.max_body_bytes) in error["message"] and error["code"] == "request_too_large"
    assert seconds < 5
    assert text == llm.offline_long[0] and reasons == ["length"]


def test_a_prompt_over_the_character_bound_is_refused_without_tokenizing(served, monkeypatch):
    llm, server, _, _ = served
    app = server.server.config.app
    limits, tokenizer = app.state.limits, app.state.tokenizer
    # The bound is safe: no token of the vocabulary covers more characters than chars_per_token.
    assert limits.chars_per_token >= max(len(t) for t in tokenizer.get_vocab())
    assert limits.max_prompt_chars == MAX_MODEL_LEN * limits.chars_per_token
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or [])
    too_long = "a" * (limits.max_prompt_chars + 1)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        error = error_of(client.post("/v1/completions", json=completion(too_long)))
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
        assert str(limits.max_prompt_chars) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
        half = too_long[: len(too_long) // 2 + 1]  # two messages that are too long together
        error = error_of(client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "system", "content": half}, {"role": "user", "content": half}]}))
        assert error["param"] == "messages" and str(limits.max_prompt_chars) in error["message"]
    assert calls == []


def test_prompts_are_tokenized_off_the_engine_thread(served, monkeypatch):
    """The server's tokenizer is held up until a stream finishes: that can only happen if the
    engine keeps stepping while a prompt is being tokenized."""
    import threading

    llm, server, _, _ = served
    tokenizer = server.server.config.app.state.tokenizer
    real_encode, stream_done, threads, steps_meanwhile = tokenizer.encode, threading.Event(), [], []

    def slow_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        if args and args[0] == PROMPTS[1]:
            start = len(llm.engine.history)
            stream_done.wait(30)
            steps_meanwhile.append(len(llm.engine.history) - start)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            started = asyncio.Event()
            stream = asyncio.ensure_future(stream_text(client, completion(PROMPTS[0], max_tokens=LONG), started))
            await asyncio.wait_for(started.wait(), 30)
            slow = asyncio.ensure_future(client.post("/v1/completions", json=completion(PROMPTS[1])))
            result = await asyncio.wait_for(stream, 25)
            stream_done.set()
            return result, await slow

    (text, _, _), r = asyncio.run(main())
    assert text == llm.offline_long[0] and r.status_code == 200
    assert steps_meanwhile[0] > 0  # the engine stepped while the prompt was being tokenized
    assert threads and all(name.startswith("tinyserve-tokenize") for name in threads)


# -- issue 12, item 7: malformed chat content, unknown paths and methods --------------------------

@pytest.mark.parametrize("content,param", [
    ([{"type": "text", "text": 5}], "messages.0.content.0.text"),
    ([{"type": "text"}], "messages.0.content.0.text"),
    ([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}], "messages.0.content.0.type"),
    ([{"type": "text", "text": "What is this?"}, {"type": "input_audio", "input_audio": {}}],
     "messages.0.content.1.type"),
    ([{"text": "no type"}], "messages.0.content.0.type"),
    ([5], "messages.0.content"),
    (None, "messages.0.content"),
])
def test_malformed_or_unsupported_chat_content_gets_a_400(served, content, param):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": content}]})
    assert error_of(r)["param"] == param


def test_text_content_parts_are_read_as_the_same_text(served):
    _, server, _, chat = served
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:7]},
                                              {"type": "text", "text": m["content"][7:]}]} for m in CHAT]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": parts, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == chat


def test_unknown_paths_and_wrong_methods_get_openai_error_bodies(served):
    _, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert error_of(client.get("/v1/nothing"), 404)["code"] == "not_found"
        assert error_of(client.post("/v1/engines/tiny/completions", json={}), 404)["code"] == "not_found"
        r = client.get("/v1/completions")
        assert error_of(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
        assert error_of(client.post("/health"), 405)["code"] == "method_not_allowed"


# -- /metrics ------------------------------------------------------------------------------------

def scrape(client: httpx.Client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}


GAUGES = ["tinyserve:num_requests_running", "tinyserve:num_requests_waiting", "tinyserve:num_requests_swapped",
          "tinyserve:gpu_cache_usage_perc", "tinyserve:cpu_cache_usage_perc"]


def test_metrics_follow_the_engine_and_read_zero_when_idle(served):
    llm, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=60) as client:
        wait_until_idle(llm.engine)
        before = scrape(client)
        assert {name: before[name] for name in GAUGES} == dict.fromkeys(GAUGES, 0.0)
        with client.stream("POST", "/v1/completions", json=completion(PROMPTS[2], max_tokens=LONG, stream=True)) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            during = scrape(client)
            assert "data: [DONE]" in list(lines)
        assert during["tinyserve:num_requests_running"] == 1 and during["tinyserve:gpu_cache_usage_perc"] > 0
        r = client.post("/v1/completions", json=completion(PROMPTS[0]))
        wait_until_idle(llm.engine)
        after = scrape(client)
    assert {name: after[name] for name in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    generated = after["tinyserve:generation_tokens_total"] - before["tinyserve:generation_tokens_total"]
    assert generated == LONG + r.json()["usage"]["completion_tokens"]
    assert after["tinyserve:num_preemptions_total"] == before["tinyserve:num_preemptions_total"]  # a roomy cache


LATENCIES = ("tinyserve:time_to_first_token_seconds", "tinyserve:time_per_output_token_seconds",
             "tinyserve:e2e_request_latency_seconds")


def test_the_server_exports_the_histograms_after_a_completion(served):
    llm, server, _, _ = served
    with httpx.Client(base_url=server.url, timeout=60) as client:
        wait_until_idle(llm.engine)
        before = scrape(client)
        assert client.post("/v1/completions", json=completion(PROMPTS[1])).status_code == 200
        wait_until_idle(llm.engine)
        after = scrape(client)
    gained = {name: after[name + "_count"] - before[name + "_count"] for name in LATENCIES}
    assert gained == {LATENCIES[0]: 1, LATENCIES[1]: MAX_TOKENS - 1, LATENCIES[2]: 1}
    e2e = after[LATENCIES[2] + "_sum"] - before[LATENCIES[2] + "_sum"]
    first = after[LATENCIES[0] + "_sum"] - before[LATENCIES[0] + "_sum"]
    rest = after[LATENCIES[1] + "_sum"] - before[LATENCIES[1] + "_sum"]
    assert 0 < first < e2e and abs(first + rest - e2e) < 1e-6  # the pieces add up to the whole


# -- the command line ----------------------------------------------------------------------------

def test_swap_space_flag_reaches_the_engine(monkeypatch):
    from tinyserve.serve import cli

    seen = {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            seen.update(kwargs)
            self.engine = "engine"

    monkeypatch.setattr(cli, "LLM", FakeLLM)
    monkeypatch.setattr(cli, "create_app", lambda engine, name, settings=None: ("app", engine))
    monkeypatch.setattr(cli.uvicorn, "run", lambda app, **kw: seen.update(app=app))
    cli.main(["--swap-space", "2.5"])
    assert seen["swap_space"] == 2.5 and seen["app"] == ("app", "engine")
    assert cli.parser().parse_args([]).swap_space == 1.0
    for bad in ["-1", "nan", "inf", "lots"]:
        with pytest.raises(SystemExit):
            cli.parser().parse_args(["--swap-space", bad])


# -- a request that can never fit ------------------------------------------------------------------

def test_a_request_that_can_never_fit_is_refused_and_the_server_goes_on(tiny_loaded):
    """Four samples of 100 tokens need 52 blocks of a 16-block cache: the scheduler gives up on
    the request ("ignored", with its reason) instead of spinning, and the server says so."""
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    engine = LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=16, num_cpu_blocks=8),
                       SchedulerConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN),
                       executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))
    huge = completion(PROMPTS[0], n=4, max_tokens=100, temperature=1, seed=0)
    with ServerThread(create_app(engine, model_name="tiny")) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        error = error_of(client.post("/v1/completions", json=huge))
        assert error["code"] == "request_cannot_fit" and "max_tokens" in error["message"]
        # Streamed, it is refused before the stream starts, or ends with an error event.
        with client.stream("POST", "/v1/completions", json={**huge, "stream": True}) as r:
            r.read()
        if r.status_code == 200:
            events = sse_events(r.text.splitlines())
            assert events[-1]["error"]["code"] == "request_cannot_fit"
            assert {c["finish_reason"] for e in events[:-1] for c in e["choices"]} - {None} == {"ignored"}
        else:
            assert error_of(r)["code"] == "request_cannot_fit"
        # The server goes on serving.
        r = client.post("/v1/completions", json=completion(PROMPTS[0]))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        wait_until_idle(engine)
        metrics = scrape(client)
    assert {name: metrics[name] for name in GAUGES} == dict.fromkeys(GAUGES, 0.0)
    assert_all_blocks_free(engine)
