"""Follow-ups of issue 36 in the server: a list of prompts answered off the event loop and added to
the engine all at once (or not at all), the tokenizer routes under an API key, and vLLM's
``prompt_logprobs`` on ``/v1/chat/completions``.

The references are independent of the code under test: each prompt of a list sent as a request
of its own (greedy, so the same tokens); what the engine holds at each of its steps, observed by
wrapping ``engine.step``; and, for a chat's prompt logprobs, the transformers tokenizer's own
rendering of the chat fed to a separate offline engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

import tinyserve.serve.jsonbody as jsonbody
from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerSettings, ServerThread, create_app
from tinyserve.serve.loop import EngineLoop, RequestRefused
from tinyserve.worker import Worker

PROMPTS = ["Hello, my name is", "The capital of France", "One two three four five", "Once upon a time"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]
MAX_MODEL_LEN = 256


def make_engine(loaded) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=192, num_cpu_blocks=16),
                     SchedulerConfig(max_num_seqs=16, max_model_len=MAX_MODEL_LEN),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


@pytest.fixture(scope="module")
def served(tiny_loaded):
    engine = make_engine(tiny_loaded)
    with ServerThread(create_app(engine, model_name="tiny")) as server:
        server.engine = engine
        yield server


def in_engine(engine: LLMEngine) -> list[str]:
    """The ids of the requests the engine's scheduler holds."""
    sched = engine.scheduler
    return [g.request_id for q in (sched.waiting, sched.running, sched.swapped) for g in q]


@contextlib.contextmanager
def observed_steps(engine: LLMEngine):
    """Record, before each engine step, the requests the engine holds (the step wrapped in place)."""
    seen: list[list[str]] = []
    step = engine.step

    def recording_step():
        seen.append(in_engine(engine))
        return step()

    engine.step = recording_step
    try:
        yield seen
    finally:
        del engine.step  # the class's own again


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        return client.post(path, json=body)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def completion(prompt, **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def wait_until_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still has requests"
        time.sleep(0.05)


# -- 1. a list's plain answer is built and encoded off the event loop ----------------------------

def test_a_list_answer_is_built_and_encoded_off_the_event_loop(served, monkeypatch):
    calls: list[tuple[str, bool]] = []
    real = jsonbody.json_chunks

    def recording(obj, *args, **kwargs):
        # Called with what the answer's builder made, on the thread that made it.
        calls.append((threading.current_thread().name, not isinstance(obj["choices"], list)))
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(jsonbody, "json_chunks", recording)
    body = completion(PROMPTS, max_tokens=200, logprobs=5)
    with httpx.Client(base_url=served.url, timeout=120) as client:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(calls) == 1, "the list's answer did not go through jsonbody"
    thread, lazy = calls[0]
    assert thread != served.thread.name and thread != threading.main_thread().name  # not the event loop's
    assert lazy  # choices made one at a time, as a single prompt's
    raw = r.content
    assert r.headers["content-length"] == str(len(raw)) and len(raw) > 100_000
    together = r.json()
    monkeypatch.undo()
    # The same answer as the prompts one request each.
    singles = [ok(post(served, "/v1/completions", completion(p, max_tokens=200, logprobs=5))) for p in PROMPTS]
    assert [c["index"] for c in together["choices"]] == list(range(len(PROMPTS)))
    for single, choice in zip(singles, together["choices"]):
        assert choice["text"] == single["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == single["choices"][0]["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(single["choices"][0]["logprobs"]
                                                                     ["token_logprobs"], abs=1e-5)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert together["usage"][key] == sum(s["usage"][key] for s in singles)


# -- 2. the prompts of a list enter the engine together, or not at all ---------------------------

def test_every_prompt_of_a_list_is_in_the_engine_before_any_step(served):
    engine = served.engine
    # Another request keeps the engine stepping while the list arrives.
    busy = threading.Thread(target=post, args=(served, "/v1/completions", completion("Busy", max_tokens=120)))
    with observed_steps(engine) as seen:
        busy.start()
        for _ in range(3):
            ok(post(served, "/v1/completions", completion(PROMPTS, max_tokens=4)))
        busy.join(60)
    lists: dict[str, set[str]] = {}
    for held in seen:
        for rid in held:
            if rid.startswith("cmpl-") and rid.rsplit("-", 1)[-1].isdigit() and rid.count("-") == 2:
                lists.setdefault(rid.rsplit("-", 1)[0], set()).add(rid)
    assert len(lists) == 3, lists
    for prefix in lists:
        first = next(held for held in seen if any(r.startswith(prefix + "-") for r in held))
        assert sorted(r for r in first if r.startswith(prefix + "-")) == [f"{prefix}-{i}" for i in range(4)]


def test_a_prompt_the_engine_refuses_leaves_none_of_the_list_added(served):
    engine = served.engine
    wait_until_idle(engine)
    added: list[str] = []
    add_request = engine.add_request

    def refusing(request_id, prompt, params, prompt_token_ids=None, *args, **kwargs):
        if prompt_token_ids == [7, 7, 7, 7, 7]:
            raise ValueError(f"request {request_id!r}: this engine refuses the prompt")
        add_request(request_id, prompt, params, prompt_token_ids, *args, **kwargs)
        added.append(request_id)

    engine.add_request = refusing
    try:
        with observed_steps(engine) as seen:
            r = post(served, "/v1/completions", completion([[1, 2, 3], [7, 7, 7, 7, 7], [4, 5, 6]]))
            stepped_after = list(seen)
    finally:
        del engine.add_request
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt.1" and "prompt 1" in error["message"] and "refuses" in error["message"]
    assert len(added) == 1  # the first was in, and was taken out again
    assert added[0] not in in_engine(engine) and not any(added[0] in held for held in stepped_after)
    bm = engine.scheduler.block_manager
    assert not bm.block_tables and bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert len(ok(post(served, "/v1/completions", completion([[1, 2, 3], [4, 5, 6]])))["choices"]) == 2


def test_add_many_is_all_or_nothing_on_the_loop_itself(tiny_loaded):
    engine = make_engine(tiny_loaded)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True) for _ in range(3)]

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        try:
            vocab = engine.vocab_size
            with pytest.raises(RequestRefused) as refused:  # a token id outside the vocabulary
                await loop.add_many([("a", [1, 2], params[0]), ("b", [1, vocab], params[1]), ("c", [3], params[2])])
            assert refused.value.index == 1 and isinstance(refused.value, ValueError)
            assert in_engine(engine) == [] and not loop._mailboxes
            boxes = await loop.add_many([("a", [1, 2], params[0]), ("b", [1, 2, 3], params[1])])
            outs = [await box.get() for box in boxes]
            while not all(o.finished for o in outs):
                outs = [o if o.finished else await box.get() for o, box in zip(outs, boxes)]
            return outs
        finally:
            await loop.stop()

    outs = asyncio.run(run())
    assert [o.request_id for o in outs] == ["a", "b"] and all(len(o.outputs[0].token_ids) == 3 for o in outs)


# -- 3. the tokenizer routes under an API key --------------------------------------------------

def test_under_an_api_key_the_tokenizer_routes_need_it_and_health_stays_open(tiny_loaded):
    """vLLM guards only /v1 (and /v2, /inference, /cohere) paths; tinyserve guards these too
    (tokenizer_routes.py says why): what is pinned here is tinyserve's choice."""
    app = create_app(make_engine(tiny_loaded), model_name="tiny", settings=ServerSettings(api_key="s3cret"))
    requests = [("POST", "/tokenize", {"prompt": "Hello"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
                ("GET", "/tokenizer_info", None), ("GET", "/version", None), ("GET", "/v1/models/tiny", None)]
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        for method, path, body in requests:
            r = client.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, (path, r.text)
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


# -- 4. prompt_logprobs on /v1/chat/completions ------------------------------------------------

def test_chat_prompt_logprobs_are_the_offline_engines_for_the_rendered_chat(served, tiny_loaded, tiny_model_dir):
    k = 3
    reference = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = reference.encode(reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    offline = make_engine(tiny_loaded)
    offline.add_request("offline", None, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), ids)
    want = None
    while offline.has_unfinished_requests():
        want = next((o for o in offline.step() if o.finished), want)

    answer = ok(post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 4,
                                                      "temperature": 0, "prompt_logprobs": k}))
    got = answer["prompt_logprobs"]
    assert answer["usage"]["prompt_tokens"] == len(ids) == len(got)
    assert "prompt_logprobs" not in answer["choices"][0]  # vLLM's: the answer's, not a choice's
    assert got[0] is None and want.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry, expected = got[pos], want.prompt_logprobs[pos]
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(expected[ids[pos]], abs=1e-4)
        assert entry[str(ids[pos])]["decoded_token"] == reference.decode([ids[pos]])
        ranked = sorted(((int(t), e) for t, e in entry.items() if e["rank"] is not None), key=lambda te: te[1]["rank"])
        top = sorted(expected.items(), key=lambda tv: tv[1], reverse=True)[:k]
        assert [e["rank"] for _, e in ranked] == list(range(1, k + 1))
        assert [e["logprob"] for _, e in ranked] == pytest.approx([v for _, v in top], abs=1e-4)
        assert {t for t, _ in ranked} == {t for t, _ in top}
    # Without it, none; with a stream, refused by name (as vLLM).
    plain = ok(post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2}))
    assert "prompt_logprobs" not in plain
    r = post(served, "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2, "stream": True,
                                              "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
