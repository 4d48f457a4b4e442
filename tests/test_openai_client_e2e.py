"""The official ``openai`` client against the real server (issue 36, item 7).

``python -m tinyserve.serve`` runs as a process of its own on the session's tiny model, as a user
starts it, and the client nobody here wrote drives it through models, chat, completions, a list
of prompts, streaming, logprobs, structured output, tools and an error. The independent
reference: the same tiny model run offline in this process (``tinyserve.LLM``) on the same
prompt tokens, greedy or with the same seed; schemas checked by ``jsonschema``, regexes by ``re``.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import jsonschema
import openai
import pytest
from cli_serving import free_port, wait_until_serving

from tinyserve import LLM, SamplingParams
from tinyserve.guided_params import GuidedDecodingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["Hello, my name is", "The capital of France"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def process(tiny_model_dir, tmp_path_factory):
    """``python -m tinyserve.serve`` on the tiny model, started (not yet serving): (process, port,
    log path). The process is stopped after the module, whatever happened."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("openai-e2e") / "server.log"
    with open(log_path, "w") as log:  # a file, not a pipe: the server never blocks on a full pipe
        proc = subprocess.Popen([sys.executable, "-m", "tinyserve.serve", "--port", str(port), "--model",
                                 str(tiny_model_dir), "--served-model-name", "tiny", "--device", "cpu",
                                 "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks", "64",
                                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc, port, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def llm(process, tiny_model_dir) -> LLM:
    """The offline reference, loaded while the server starts."""
    return LLM(model=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def server(process, llm) -> str:
    proc, port, log_path = process
    wait_until_serving(proc, port, log_path.read_text)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def reference(llm: LLM, ids: list[int], **params):
    return llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(**params))[0]


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def test_chat_plain_and_streamed_are_the_offline_answer(client, llm):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    ids = chat_ids(llm, MESSAGES)
    expected = reference(llm, ids, temperature=0, max_tokens=12).outputs[0]
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_logprobs_are_the_offline_logprobs(client, llm):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    expected = reference(llm, chat_ids(llm, MESSAGES), temperature=0, max_tokens=6, logprobs=3).outputs[0]
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token, offline in zip(content, expected.token_ids, expected.logprobs):
        assert entry.token == llm.tokenizer.decode([token]) and math.isclose(entry.logprob, offline[token],
                                                                           abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token  # greedy: the likeliest
        best = sorted(offline.values(), reverse=True)[:3]
        assert all(math.isclose(t.logprob, v, abs_tol=1e-4) for t, v in zip(entry.top_logprobs, best))


def test_completion_single_and_streamed(client, llm):
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == expected.finish_reason
    stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text


def test_a_list_of_prompts_with_n_2(client, llm):
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=1.0, n=2, seed=7)
    expected = llm.generate(PROMPTS, SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8))
    # Choice i * n + j is prompt i's sample j; the usage counts every prompt and sample.
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.text for out in expected for o in sorted(out.outputs,
                                                                                      key=lambda o: o.index)]
    assert r.usage.prompt_tokens == sum(len(out.prompt_token_ids) for out in expected)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for out in expected for o in out.outputs)


def test_completion_echo_with_logprobs(client, llm):
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                  logprobs=1)
    expected = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                                       prompt_logprobs=1))[0]
    choice = r.choices[0]
    assert choice.text == PROMPTS[1] + expected.outputs[0].text
    ids = expected.prompt_token_ids + list(expected.outputs[0].token_ids)
    entries = expected.prompt_logprobs + expected.outputs[0].logprobs
    assert choice.logprobs.tokens == [llm.tokenizer.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    for value, token, entry in zip(choice.logprobs.token_logprobs[1:], ids[1:], entries[1:]):
        assert math.isclose(value, entry[token], abs_tol=1e-4)


def test_structured_output(client, llm):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "weather", "schema": SCHEMA, "strict": True}})
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == reference(llm, chat_ids(llm, MESSAGES), temperature=0, max_tokens=60,
                             guided_decoding=GuidedDecodingParams(json=SCHEMA)).outputs[0].text
    regex = r"[0-9]{3}-[a-z]{2}"
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=20, temperature=1.0, n=2, seed=1,
                                  extra_body={"guided_regex": regex})
    assert len(r.choices) == 4 and all(re.fullmatch(regex, c.text) for c in r.choices)


def test_named_tool_call(client, llm):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                       tools=[WEATHER], tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    # The tiny model's template writes no tools: the prompt is the messages' alone.
    assert call.function.arguments == reference(llm, chat_ids(llm, MESSAGES), temperature=0, max_tokens=60,
                                                guided_decoding=GuidedDecodingParams(json=SCHEMA)).outputs[0].text


def test_errors_are_bad_requests_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="auto")
    assert e.value.body["param"] == "tool_choice" and "auto" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPTS[0], extra_body={"guided_regex": "[a-"})
    assert e.value.body["param"] == "guided_regex"
    # and the server goes on serving
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2).choices
