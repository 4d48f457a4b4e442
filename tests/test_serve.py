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

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLM, LLMEngine
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The future of AI is", "The life is", "List three colors:"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def served(tiny_loaded):
    """(llm, server, offline completions of PROMPTS, offline chat answer)."""
    mc = ModelConfig(model=str(tiny_loaded.path), device="cpu", dtype="float32")
    llm = LLM.__new__(LLM)  # reuse the session's loaded model rather than loading it again
    llm.engine = LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=96, num_cpu_blocks=16),
                           SchedulerConfig(max_num_seqs=8, max_model_len=MAX_MODEL_LEN),
                           executor=Worker(mc, attention_backend="torch", loaded=tiny_loaded))
    llm._counter = iter(range(10**6))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False)
    chat = llm.generate(prompt_token_ids=[chat_ids], sampling_params=greedy)[0].outputs[0].text
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
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
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
    (json.dumps(completion("x", frequency_penalty=0.5)).encode(), "frequency_penalty"),
    (json.dumps(completion("x", temprature=0.5)).encode(), "temprature"),  # a typo is not ignored
    (json.dumps(completion([10**9])).encode(), "prompt"),
    (json.dumps(completion(["a", "b"])).encode(), "prompt"),
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
    with socket.socket() as s:  # a free port (the server binds it a moment later)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve.serve", "--host", "127.0.0.1", "--port", str(port),
                             "--model", str(tiny_model_dir), "--device", "cpu", "--max-model-len", "128",
                             "--num-gpu-blocks", "32", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.25)
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


# -- the chapter's checker, and streaming text that must never be taken back ---------------------

def test_check_stream_text_accepts_a_right_answer_and_catches_the_usual_mistakes(capsys):
    from tinyserve.exercises import beyond as ex

    def right(body):
        texts = {}
        for line in body.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    piece = c["delta"].get("content") if "delta" in c else c["text"]
                    texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
        return texts

    def first_choice_only(body):
        return {0: right(body).get(0, "")}

    def last_chunk_only(body):
        events = [json.loads(line[6:]) for line in body.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return {c["index"]: c.get("text", c.get("delta", {}).get("content")) for e in events for c in e["choices"]}

    assert ex.check_stream_text(right)
    assert not ex.check_stream_text(first_choice_only)
    assert not ex.check_stream_text(last_chunk_only)
    assert "✗ stream_text" in capsys.readouterr().out


def test_a_stream_holds_back_what_could_still_become_a_stop_string_or_a_character():
    from tinyserve.engine import CompletionOutput, RequestOutput
    from tinyserve.exercises.beyond import stream_body

    # The engine's text so far, step by step: "ab" + half a character, then the stop "XYZ" is
    # forming (the engine cuts it when complete), then the end.
    texts = ["a", "ab\ufffd", "abé", "abéX", "abéXY", "abé"]
    outs = [RequestOutput("r", None, [1], [CompletionOutput(0, t, [], "stop" if i == len(texts) - 1 else None)],
                          finished=i == len(texts) - 1) for i, t in enumerate(texts)]

    body = stream_body(outs, chat=False, include_usage=False, n=1, stop=["XYZ"])
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in body.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(pieces) == "abé"
    assert all("\ufffd" not in p and "X" not in p for p in pieces)
