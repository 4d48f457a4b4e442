"""Beam search over HTTP (issue 37): ``use_beam_search``, ``length_penalty`` and ``early_stopping``
as vLLM v0.4's OpenAI server took them, answered with the offline engine's beams."""

from __future__ import annotations

import httpx
import pytest
from test_serve_schema import make_engine

from tinyserve.sampling_params import SamplingParams
from tinyserve.serve import ServerThread, create_app

PROMPT = "The future of AI is"


@pytest.fixture(scope="module")
def served(tiny_loaded):
    server = ServerThread(create_app(make_engine(tiny_loaded), model_name="tiny")).start()
    try:
        yield server
    finally:
        server.stop()


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.post(path, json={"model": "tiny", "temperature": 0, **body})


def offline_beams(loaded, ids: list[int], **params) -> list[tuple[str, float]]:
    engine = make_engine(loaded)
    engine.add_request("r", None, SamplingParams(use_beam_search=True, temperature=0, **params), prompt_token_ids=ids)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return [(c.text, c.cumulative_logprob) for c in out.outputs]


@pytest.mark.parametrize("fields", [{"best_of": 4, "n": 2}, {"best_of": 3, "n": 3, "length_penalty": 0.5},
                                    {"best_of": 2, "n": 1, "early_stopping": "never"},
                                    {"best_of": 5, "n": 2, "early_stopping": True, "length_penalty": 0.0}])
def test_completions_beams_are_the_engines(served, tiny_loaded, fields):
    body = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "use_beam_search": True,
                                            "logprobs": 0, **fields}).json()
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    expected = offline_beams(tiny_loaded, ids, max_tokens=8, **fields)
    assert [c["text"] for c in body["choices"]] == [text for text, _ in expected]
    assert [c["index"] for c in body["choices"]] == list(range(fields["n"]))
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in body["choices"]]
    assert sums == pytest.approx([score for _, score in expected], abs=1e-4)


def test_chat_beams_use_n_as_the_width(served):
    body = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3,
                                                 "max_tokens": 6, "use_beam_search": True}).json()
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3  # three different beams


@pytest.mark.parametrize("fields,param", [
    ({"use_beam_search": True, "best_of": 2, "stream": True}, "use_beam_search"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "n": 1}, "best_of"),  # a width of one is not a beam search (v0.4's rule)
    ({"length_penalty": 2.0}, "length_penalty"),  # only with beam search, as in v0.4
    ({"early_stopping": "sometimes"}, "early_stopping"),
])
def test_beam_fields_are_checked_as_v04_does(served, fields, param):
    r = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
