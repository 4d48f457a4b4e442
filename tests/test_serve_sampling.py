"""v0.4's sampling features over HTTP: completions' ``logprobs``, ``echo`` (with ``max_tokens=0``, as
evaluation harnesses score text), ``best_of``, the penalties, ``min_p``, ``min_tokens`` and
``include_stop_str_in_output``; chat's ``logprobs`` and ``top_logprobs``; in OpenAI's formats,
streamed and not; bad values and still-unsupported fields are 400s naming the field."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.sampling_params import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPT = "Hello, my name is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def make_engine(loaded) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=96, num_cpu_blocks=16),
                     SchedulerConfig(max_num_seqs=8, max_model_len=128),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


def offline(engine: LLMEngine, params: SamplingParams, prompt=PROMPT, ids=None):
    engine.add_request("offline", prompt, params, prompt_token_ids=ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


@pytest.fixture(scope="module")
def served(tiny_loaded):
    """(server, engine for offline runs, the server's tokenizer texts)."""
    engine = make_engine(tiny_loaded)
    server = ServerThread(create_app(engine, model_name="tiny")).start()
    try:
        yield server, make_engine(tiny_loaded)
    finally:
        server.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.post(path, json={"model": "tiny", **body})


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as r:
            assert r.status_code == 200, r.read()
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def texts_of(engine, ids):
    return [engine.tokenizer.decode([t]) for t in ids]


GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


# -- completions ---------------------------------------------------------------------------------

def test_completion_logprobs_are_the_engines_in_openai_format(served):
    server, engine = served
    body = post(server, "/v1/completions", {"prompt": PROMPT, **GREEDY, "logprobs": 2}).json()
    want = offline(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)).outputs[0]
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == texts_of(engine, want.token_ids)
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(want.token_ids, want.logprobs)], abs=1e-4)
    texts = texts_of(engine, range(engine.vocab_size))
    assert lp["top_logprobs"] == [pytest.approx({texts[t]: v for t, v in e.items()}, abs=1e-4) for e in want.logprobs]
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])  # texts can coincide ("\ufffd" for partial bytes)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(served):
    server, engine = served
    body = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    want = offline(engine, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == texts_of(engine, want.prompt_token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [e[t] for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(served):
    server, engine = served
    want = offline(engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                          prompt_logprobs=1))
    whole = post(server, "/v1/completions", {"prompt": PROMPT, **GREEDY, "echo": True, "logprobs": 1}).json()
    c = whole["choices"][0]
    assert c["text"] == PROMPT + want.outputs[0].text
    assert len(c["logprobs"]["tokens"]) == len(want.prompt_token_ids) + 6
    events = stream(server, "/v1/completions", {"prompt": PROMPT, **GREEDY, "echo": True, "logprobs": 1})
    pieces = [e["choices"][0] for e in events]
    assert pieces[0]["text"].startswith(PROMPT)
    assert "".join(p["text"] for p in pieces) == c["text"]
    streamed = [lp for p in pieces if p["logprobs"] for lp in p["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4) and streamed[0] is None
    offsets = [o for p in pieces if p["logprobs"] for o in p["logprobs"]["text_offset"]]
    assert offsets == c["logprobs"]["text_offset"]
    # Echo without logprobs: just the text.
    plain = post(server, "/v1/completions", {"prompt": PROMPT, **GREEDY, "echo": True}).json()["choices"][0]
    assert plain["text"] == c["text"] and plain["logprobs"] is None


def test_best_of_penalties_min_p_and_min_tokens_reach_the_engine(served):
    server, engine = served
    fields = dict(n=2, best_of=4, temperature=1.0, seed=7, max_tokens=6, presence_penalty=0.5,
                  frequency_penalty=0.3, repetition_penalty=1.2, min_p=0.05, min_tokens=4)
    body = post(server, "/v1/completions", {"prompt": PROMPT, **fields}).json()
    want = offline(engine, SamplingParams(**fields))
    assert [c["text"] for c in body["choices"]] == [c.text for c in want.outputs]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(len(c.token_ids) >= 4 for c in want.outputs)
    # Streamed, best_of > n arrives whole at the end (which samples win is known only then).
    events = stream(server, "/v1/completions", {"prompt": PROMPT, **fields})
    texts = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in (0, 1)}
    assert [texts[0], texts[1]] == [c.text for c in want.outputs]


def test_include_stop_str_in_output_over_http(served):
    server, engine = served
    text = offline(engine, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)).outputs[0].text
    stop = text[2:4]
    start = text.find(stop)
    for include, expected in ((False, text[:start]), (True, text[:start + len(stop)])):
        body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 10, "ignore_eos": True, "stop": stop,
                "include_stop_str_in_output": include}
        choice = post(server, "/v1/completions", body).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
        streamed = stream(server, "/v1/completions", body)
        assert "".join(e["choices"][0]["text"] for e in streamed) == expected


# -- chat ----------------------------------------------------------------------------------------

def test_chat_logprobs_in_openai_chat_format_streamed_or_not(served):
    server, engine = served
    body = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "logprobs": True,
                                                  "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 6
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]
    for entry in content:
        assert [t["logprob"] for t in entry["top_logprobs"]] == sorted((t["logprob"] for t in entry["top_logprobs"]),
                                                                       reverse=True)
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= entry["top_logprobs"][0]["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())
    events = stream(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "logprobs": True,
                                                      "top_logprobs": 2})
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    off = post(server, "/v1/chat/completions", {"messages": CHAT, **GREEDY}).json()
    assert off["choices"][0]["logprobs"] is None


# -- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"best_of": 1, "n": 2, "temperature": 1}, "best_of"),
    ("/v1/completions", {"best_of": 3}, "best_of"),  # greedy
    ("/v1/completions", {"best_of": 17, "temperature": 1}, "best_of"),
    ("/v1/completions", {"best_of": 9, "temperature": 1}, "best_of"),  # more than max_num_seqs
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 7, "max_tokens": 6}, "min_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"logit_bias": {"5": -100.5}}, "logit_bias"),  # OpenAI's range is [-100, 100]
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),  # not a chat field
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools.0.function"),
])
def test_bad_values_and_unsupported_fields_are_400s_naming_the_field(served, path, fields, param):
    server, _ = served
    base = {"prompt": PROMPT, "max_tokens": 6} if path == "/v1/completions" else {"messages": CHAT, "max_tokens": 6}
    r = post(server, path, {**base, "temperature": 0, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_client_leaving_a_best_of_or_n_stream_frees_every_block(served):
    server, _ = served
    engine = server.server.config.app.state.engine
    for fields in ({"n": 3}, {"n": 1, "best_of": 3}):
        body = {"model": "tiny", "prompt": PROMPT, "temperature": 1.0, "seed": 1, "max_tokens": 100,
                "ignore_eos": True, "stream": True, "logprobs": 1, **fields}
        with httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())  # the first chunk, then the client leaves
        # The connection is closed mid-answer: the request is aborted (or has just finished), and
        # every block of its samples comes back.
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the abandoned request is still running"
            time.sleep(0.05)
        bm = engine.scheduler.block_manager
        time.sleep(0.1)
        assert not bm.block_tables and bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
