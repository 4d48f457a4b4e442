"""Structured output over HTTP (issue 36, item 4): ``response_format``, vLLM's ``guided_*`` fields,
``logit_bias``, ``allowed_token_ids``, ``bad_words`` and tools, through the server.

The independent references: every structured answer is checked by a library that is not the one
that made it (``jsonschema.validate`` for a schema, ``json.loads`` for a JSON object,
``re.fullmatch`` for a regex or the Lark grammar's equivalent, membership for a choice); and the
server's answer is the offline engine's own output (an ``LLMEngine`` run directly, here, on the
same prompt tokens and ``SamplingParams(guided_decoding=...)``), greedy and seeded. A chat
prompt's tokens are the tokenizer's own ``apply_chat_template`` (with the tools, when given).
A stream's pieces joined are the plain answer. Each check can fail: a grammar that let one
wrong token through, a server that lost a constraint on the way to the engine, or a stream
that cut a tool call differently, would each show.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from test_serve_schema import reference_ids

from tinyserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.sequence import SamplingParams
from tinyserve.serve import ServerThread, create_app
from tinyserve.worker import Worker

PROMPT = "Hello, my name is"
HELLO = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 100  # every schema below ends well before this (a cut answer would not validate)
# The tiny model's template, with the tools written first (names and descriptions; their schemas
# would not fit the tiny model's context) as templates that take tools do: the prompt then depends on them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.description }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


# Bounded (lengths, ranges, item counts), so a random model's answer ends within MAX_TOKENS.
SCHEMAS = {
    "string_and_integer": obj({"city": {"type": "string", "maxLength": 8},
                               "n": {"type": "integer", "minimum": 0, "maximum": 99}}),
    "enum": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "integer_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 1, "maxItems": 4},
    "boolean_and_null": obj({"ok": {"type": "boolean"}, "note": {"type": "null"}}),
    "nested": obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                         "maxItems": 2}})}),
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "maxLength": 5}]},
    "const_and_pattern": obj({"kind": {"const": "point"},
                              "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "number": obj({"x": {"type": "number", "minimum": -1, "maximum": 1}}),
    "mixed_enum": {"enum": ["a", 1, True, None]},
    "object_array": {"type": "array", "items": obj({"k": {"type": "string", "maxLength": 3},
                                                    "v": {"type": "integer", "minimum": 0, "maximum": 9}}),
                     "minItems": 1, "maxItems": 3},
    "optional_field": obj({"a": {"type": "integer", "minimum": 0, "maximum": 5},
                           "b": {"type": "string", "maxLength": 3}}, required=["a"]),
    "refs": {"$defs": {"pt": obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
             **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}})},
    "string_enum": {"type": "string", "enum": ["yes", "no", "maybe"]},
}
REGEXES = [r"[0-9]{3}-[a-z]{2}", r"(yes|no), [A-Z][a-z]{1,4}\.", r"\d{1,2}:\d{2} (am|pm)"]
CHOICES = ["Paris", "London", "New York", "東京"]
# A Lark grammar and the regex that says the same (the independent check).
LARK = 'start: greeting " " name "!"\ngreeting: "hi" | "hello"\nname: /[a-z]{2,5}/'
LARK_AS_REGEX = r"(hi|hello) [a-z]{2,5}!"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": SCHEMAS["string_and_integer"]}}
POINT = {"type": "function", "function": {"name": "make_point", "description": "A point.",
                                          "parameters": SCHEMAS["refs"]}}
NOOP = {"type": "function", "function": {"name": "noop"}}  # no parameters: any object
TOOLS = [WEATHER, POINT, NOOP]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def make_engine(loaded, num_gpu_blocks: int = 96, max_model_len: int = 256, prefix_caching: bool = False) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=8, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=32,
                                     enable_prefix_caching=prefix_caching),
                     SchedulerConfig(max_num_seqs=8, max_model_len=max_model_len),
                     executor=Worker(mc, attention_backend="torch", loaded=loaded))


@pytest.fixture(scope="module")
def served(tiny_loaded):
    server = ServerThread(create_app(make_engine(tiny_loaded), model_name="tiny"))
    server.server.config.app.state.tokenizer.chat_template = TOOLS_TEMPLATE
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def reference(tiny_loaded) -> LLMEngine:
    """An engine of its own, run directly: the server's answers must be its outputs."""
    return make_engine(tiny_loaded)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


_ids = itertools.count()


def offline(engine: LLMEngine, ids: list[int], **params):
    """The engine's finished output for one request, run alone."""
    rid = f"reference-{next(_ids)}"
    engine.add_request(rid, None, SamplingParams(**params), prompt_token_ids=ids)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                done = out
    assert done is not None and not done.error
    return done


def offline_texts(engine: LLMEngine, ids: list[int], **params) -> list[str]:
    return [c.text for c in sorted(offline(engine, ids, **params).outputs, key=lambda c: c.index)]


def prompt_ids(server: ServerThread) -> list[int]:
    return copy.deepcopy(server.server.config.app.state.tokenizer).encode(PROMPT)


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post(path, json=body)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server: ServerThread, path: str, body: dict) -> tuple[dict[int, str], dict[int, str], list[dict]]:
    """A streamed answer: each choice's joined text, each choice's finish_reason, and the chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = []
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            chunks.append(chunk)
            for ch in chunk["choices"]:
                piece = ch["text"] if "text" in ch else ch["delta"].get("content") or ""
                texts[ch["index"]] = texts.get(ch["index"], "") + piece
                if ch["finish_reason"] is not None:
                    reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons, chunks


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": HELLO, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def texts_of(body: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in sorted(body["choices"],
                                                                                   key=lambda c: c["index"])]


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- JSON schemas: chat (response_format) greedy and streamed, completions (guided_json) seeded ------

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_response_format_json_schema_greedy_validates_and_is_the_engine_output(served, reference, name):
    schema = SCHEMAS[name]
    body = chat(response_format=json_schema_format(name, schema))
    answer = ok(post(served, "/v1/chat/completions", body))
    (text,) = texts_of(answer)
    assert answer["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), schema)
    ids = reference_ids(served, HELLO)
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert offline_texts(reference, ids, temperature=0, max_tokens=MAX_TOKENS,
                         guided_decoding=GuidedDecodingParams(json=schema)) == [text]
    pieces, reasons, _ = streamed(served, "/v1/chat/completions", body)
    assert pieces == {0: text} and reasons == {0: "stop"}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_guided_json_sampled_validates_and_is_the_engine_output(served, reference, name):
    schema = SCHEMAS[name]
    body = completion(guided_json=schema, temperature=1.0, n=2, seed=11)
    answer = ok(post(served, "/v1/completions", body))
    texts = texts_of(answer)
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert offline_texts(reference, prompt_ids(served), temperature=1.0, n=2, seed=11, max_tokens=MAX_TOKENS,
                         guided_decoding=GuidedDecodingParams(json=schema)) == texts
    if name in ("refs", "object_array"):  # the longest answers, streamed: the same samples
        pieces, _, _ = streamed(served, "/v1/completions", body)
        assert pieces == dict(enumerate(texts))


def test_guided_json_as_text_is_the_same_schema(served):
    schema = SCHEMAS["refs"]
    as_dict = texts_of(ok(post(served, "/v1/completions", completion(guided_json=schema))))
    as_text = texts_of(ok(post(served, "/v1/completions", completion(guided_json=json.dumps(schema)))))
    assert as_dict == as_text
    jsonschema.validate(json.loads(as_text[0]), schema)


# Any JSON object has no bound on its length: a random model's key can run past any max_tokens
# (seed 2 of chat does, cut with finish_reason "length"). These seeds close theirs: chat's within
# 60 to 80 tokens, completions' at once ({}).
@pytest.mark.parametrize("path,seed", [("/v1/chat/completions", None), ("/v1/chat/completions", 8),
                                       ("/v1/chat/completions", 11), ("/v1/completions", None),
                                       ("/v1/completions", 1)])
def test_json_object_parses_to_a_dict(served, reference, path, seed):
    sampled = {} if seed is None else {"temperature": 1.0, "n": 2, "seed": seed}
    make = chat if path.endswith("chat/completions") else completion
    answer = ok(post(served, path, make(response_format={"type": "json_object"}, **sampled)))
    texts = texts_of(answer)
    for text, c in zip(texts, answer["choices"]):
        assert c["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text
    ids = reference_ids(served, HELLO) if make is chat else prompt_ids(served)
    assert offline_texts(reference, ids, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(json_object=True),
                         **{"temperature": 0, **sampled}) == texts


# -- regex, choice, Lark ------------------------------------------------------------------------

@pytest.mark.parametrize("regex", REGEXES)
def test_guided_regex_fullmatches_greedy_sampled_and_streamed(served, reference, regex):
    greedy = ok(post(served, "/v1/completions", completion(guided_regex=regex)))
    sampled = ok(post(served, "/v1/chat/completions", chat(guided_regex=regex, temperature=1.0, n=2, seed=5)))
    for text in texts_of(greedy) + texts_of(sampled):
        assert re.fullmatch(regex, text), (regex, text)
    guided = GuidedDecodingParams(regex=regex)
    assert offline_texts(reference, prompt_ids(served), temperature=0, max_tokens=MAX_TOKENS,
                         guided_decoding=guided) == texts_of(greedy)
    assert offline_texts(reference, reference_ids(served, HELLO), temperature=1.0, n=2, seed=5,
                         max_tokens=MAX_TOKENS, guided_decoding=guided) == texts_of(sampled)
    pieces, _, _ = streamed(served, "/v1/completions", completion(guided_regex=regex))
    assert pieces == {0: texts_of(greedy)[0]}


def test_guided_choice_is_one_of_the_choices(served, reference):
    answers = texts_of(ok(post(served, "/v1/completions", completion(guided_choice=CHOICES))))
    for seed in range(4):
        answers += texts_of(ok(post(served, "/v1/chat/completions",
                                    chat(guided_choice=CHOICES, temperature=1.0, n=2, seed=seed))))
    assert all(a in CHOICES for a in answers), answers
    assert offline_texts(reference, prompt_ids(served), temperature=0, max_tokens=MAX_TOKENS,
                         guided_decoding=GuidedDecodingParams(choice=CHOICES)) == answers[:1]
    pieces, _, _ = streamed(served, "/v1/chat/completions", chat(guided_choice=CHOICES))
    assert pieces[0] in CHOICES


def test_guided_grammar_lark_matches_its_regex(served, reference):
    greedy = texts_of(ok(post(served, "/v1/completions", completion(guided_grammar=LARK))))
    sampled = texts_of(ok(post(served, "/v1/completions", completion(guided_grammar=LARK, temperature=1.0,
                                                                      n=2, seed=3))))
    for text in greedy + sampled:
        assert re.fullmatch(LARK_AS_REGEX, text), text
    assert offline_texts(reference, prompt_ids(served), temperature=0, max_tokens=MAX_TOKENS,
                         guided_decoding=GuidedDecodingParams(grammar=LARK)) == greedy


# -- tools --------------------------------------------------------------------------------------

def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize("tool", TOOLS, ids=lambda t: t["function"]["name"])
def test_named_tool_call_validates_and_is_the_engine_output(served, reference, client, tool):
    name = tool["function"]["name"]
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0,
                                       tools=TOOLS, tool_choice=named(name))
    message = r.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == name and call.id
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[name])
    # The prompt is the template's with the tools; the arguments are the engine's answer under the schema.
    ids = reference_ids(served, HELLO, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids)
    assert offline_texts(reference, ids, temperature=0, max_tokens=MAX_TOKENS,
                         guided_decoding=GuidedDecodingParams(json=PARAMETERS[name])) == [call.function.arguments]


def test_streamed_named_tool_call_opens_with_the_name_then_only_arguments(served, client):
    ask = dict(model="tiny", messages=HELLO, max_tokens=MAX_TOKENS, temperature=0, tools=TOOLS,
               tool_choice=named("make_point"))
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0]
    deltas = [c.choices[0].delta.tool_calls for c in client.chat.completions.create(**ask, stream=True)
              if c.choices and c.choices[0].delta.tool_calls]
    calls = [d[0] for d in deltas]
    assert all(len(d) == 1 for d in deltas) and len(calls) > 2
    first, rest = calls[0], calls[1:]
    assert first.index == 0 and first.id and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "make_point"
    assert all(c.index == 0 and c.id is None and c.type is None and c.function.name is None for c in rest)
    assert "".join(c.function.arguments for c in calls) == whole.function.arguments
    jsonschema.validate(json.loads(whole.function.arguments), PARAMETERS["make_point"])


# "required" asks for a list of calls with no bound on its length, and a random model often goes
# on adding calls: these (tools, seed) pairs are ones whose lists end within max_tokens (both
# samples of each), two calls to make_point among them ($defs moved to the list's root).
@pytest.mark.parametrize("tools,seed", [([WEATHER, POINT], 1), ([WEATHER, NOOP], 9)], ids=["point", "noop"])
def test_required_tool_choice_calls_listed_tools_with_valid_arguments(client, tools, seed):
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=160, tools=tools,
                                       tool_choice="required", temperature=1.0, n=2, seed=seed)
    names = {t["function"]["name"] for t in tools}
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.function.name in names and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_tool_choice_cut_by_max_tokens_is_text(client):
    """A list cut short is no calls at all: its text comes back as content, finish_reason "length"."""
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40, tools=TOOLS,
                                       tool_choice="required", temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith('[{"name": "') and r.usage.completion_tokens == 40


def test_tool_choice_none_answers_text(served, reference):
    answer = ok(post(served, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="none", max_tokens=8,
                                                          ignore_eos=True)))
    message = answer["choices"][0]["message"]
    assert "tool_calls" not in message or not message["tool_calls"]
    ids = reference_ids(served, HELLO, tools=TOOLS)
    assert offline_texts(reference, ids, temperature=0, max_tokens=8, ignore_eos=True) == [message["content"]]


def test_tools_are_written_by_the_chat_template(served):
    tokenizer = copy.deepcopy(served.server.config.app.state.tokenizer)
    expected = tokenizer.apply_chat_template(HELLO, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in expected and "get_weather" not in without
    for choice in ("none", named("noop")):
        answer = ok(post(served, "/v1/chat/completions", chat(tools=TOOLS, tool_choice=choice, max_tokens=4)))
        assert answer["usage"]["prompt_tokens"] == len(tokenizer.encode(expected, add_special_tokens=False))
    plain = ok(post(served, "/v1/chat/completions", chat(max_tokens=4)))
    assert plain["usage"]["prompt_tokens"] == len(tokenizer.encode(without, add_special_tokens=False))


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_tool_choice_is_refused_by_name(served, choice):
    body = chat(tools=TOOLS)
    if choice is not None:
        body["tool_choice"] = choice
    error = error_of(post(served, "/v1/chat/completions", body))
    assert error["param"] == "tool_choice" and "auto" in error["message"]


def test_tool_choice_naming_an_unknown_function_is_refused(served, client):
    error = error_of(post(served, "/v1/chat/completions", chat(tools=TOOLS, tool_choice=named("launch"))))
    assert error["param"] == "tool_choice.function.name" and "launch" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, tool_choice=named("launch"))
    assert e.value.body["param"] == "tool_choice.function.name"


def test_required_tools_whose_defs_disagree_are_refused(served):
    """"required" moves every tool's $defs to one root: two different schemas under one name cannot both be there."""
    other = copy.deepcopy(POINT)
    other["function"]["name"] = "make_other_point"
    other["function"]["parameters"]["$defs"]["pt"]["properties"]["x"]["maximum"] = 5
    error = error_of(post(served, "/v1/chat/completions", chat(tools=[POINT, other], tool_choice="required")))
    assert error["param"] == "tools" and "$defs/pt" in error["message"]
    # The same definition twice is one definition.
    same = copy.deepcopy(POINT)
    same["function"]["name"] = "make_same_point"
    assert ok(post(served, "/v1/chat/completions", chat(tools=[POINT, same], tool_choice="required", max_tokens=2)))


def test_required_tool_choice_with_stream_is_refused(served):
    error = error_of(post(served, "/v1/chat/completions", chat(tools=TOOLS, tool_choice="required", stream=True)))
    assert error["param"] == "tool_choice" and "stream" in error["message"]


TWO_CONSTRAINTS = [
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "[a-z]+"}, "guided_regex"),
    ("/v1/completions", {"guided_json": SCHEMAS["enum"], "guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"guided_regex": "a+", "guided_grammar": LARK}, "guided_grammar"),
    ("/v1/chat/completions", {"response_format": json_schema_format("x", SCHEMAS["enum"]), "tools": TOOLS,
                              "tool_choice": named("noop")}, "tool_choice"),
    ("/v1/chat/completions", {"guided_choice": ["a"], "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("path,fields,param", TWO_CONSTRAINTS)
def test_two_constraints_are_refused_naming_the_second(served, path, fields, param):
    make = chat if path.endswith("chat/completions") else completion
    error = error_of(post(served, path, make(**fields)))
    assert error["param"] == param and "both constrain" in error["message"]


BAD_GRAMMARS = [
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "objectx"}}, "guided_json"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_grammar": "start: ("}, "guided_grammar"),
    ("/v1/completions", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("/v1/chat/completions", {"response_format": json_schema_format("x", {"type": "objectx"})}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema"),
]


@pytest.mark.parametrize("path,fields,param", BAD_GRAMMARS)
def test_a_grammar_that_cannot_compile_is_a_400_naming_its_field(served, path, fields, param):
    make = chat if path.endswith("chat/completions") else completion
    error = error_of(post(served, path, make(**fields)))
    assert error["param"] == param, error
    # The server goes on serving: plain and structured requests alike.
    plain = ok(post(served, "/v1/completions", completion(max_tokens=3, ignore_eos=True)))
    assert plain["usage"]["completion_tokens"] == 3
    (text,) = texts_of(ok(post(served, path, make(guided_regex=REGEXES[0]))))
    assert re.fullmatch(REGEXES[0], text)


def test_a_tool_whose_parameters_cannot_compile_is_a_400(served):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}
    error = error_of(post(served, "/v1/chat/completions", chat(tools=[bad], tool_choice=named("bad"))))
    # Named as the field that asked for the grammar (or the tool whose schema it is).
    assert (error["param"] == "tool_choice" or error["param"].startswith("tools")) and "objectx" in error["message"]


# -- logit_bias, allowed_token_ids, bad_words -----------------------------------------------------

def test_logit_bias_of_100_makes_greedy_output_that_token(served, reference):
    tokenizer = served.server.config.app.state.tokenizer
    token = next(t for t in range(100, 400) if t not in tokenizer.all_special_ids)
    body = completion(max_tokens=8, ignore_eos=True, logit_bias={str(token): 100}, logprobs=1)
    answer = ok(post(served, "/v1/completions", body))
    (text,) = texts_of(answer)
    out = offline(reference, prompt_ids(served), temperature=0, max_tokens=8, ignore_eos=True,
                  logit_bias={token: 100})
    assert list(out.outputs[0].token_ids) == [token] * 8 and out.outputs[0].text == text
    assert answer["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([token])] * 8
    # Without the bias the answer is something else: the bias did it.
    assert texts_of(ok(post(served, "/v1/completions", completion(max_tokens=8, ignore_eos=True)))) != [text]


@pytest.mark.parametrize("seed", [None, 7])
def test_allowed_token_ids_bound_every_output_token(served, reference, seed):
    tokenizer = served.server.config.app.state.tokenizer
    allowed = [150, 151, 200, 260, 333]
    sampled = {"temperature": 0} if seed is None else {"temperature": 1.0, "n": 2, "seed": seed}
    answer = ok(post(served, "/v1/completions", completion(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed,
                                                           logprobs=0, **sampled)))
    allowed_texts = {tokenizer.decode([t]) for t in allowed}
    for c in answer["choices"]:
        assert len(c["logprobs"]["tokens"]) == 10 and set(c["logprobs"]["tokens"]) <= allowed_texts
    out = offline(reference, prompt_ids(served), max_tokens=10, ignore_eos=True, allowed_token_ids=allowed, **sampled)
    outputs = sorted(out.outputs, key=lambda c: c.index)
    assert all(set(c.token_ids) <= set(allowed) for c in outputs)
    assert [c.text for c in outputs] == texts_of(answer)


def test_bad_words_keep_a_word_of_the_greedy_answer_out(served, reference):
    tokenizer = served.server.config.app.state.tokenizer
    plain = offline(reference, prompt_ids(served), temperature=0, max_tokens=24, ignore_eos=True)
    # A word of the unconstrained answer that the tokenizer spells as one token of it, alone.
    # (Spelled with a leading space it may differ: " are" is one token and "are" two here, and
    # vLLM's rule then leaves " are" alone for bad_words=["are"]; so does this server.)
    word = next(w for w in (tokenizer.decode([t]) for t in plain.outputs[0].token_ids)
                if re.fullmatch(r"[A-Za-z]{2,}", w) and len(tokenizer.encode(w, add_special_tokens=False)) == 1)
    assert word in plain.outputs[0].text
    answer = ok(post(served, "/v1/completions", completion(max_tokens=24, ignore_eos=True, bad_words=[word])))
    (text,) = texts_of(answer)
    assert text != plain.outputs[0].text and word not in text, (word, text)
    assert offline_texts(reference, prompt_ids(served), temperature=0, max_tokens=24, ignore_eos=True,
                         bad_words=[word]) == [text]


# -- many at once, with preemption and prefix caching ---------------------------------------------

def test_structured_answers_stay_valid_under_preemption(tiny_loaded, reference):
    """Structured and plain requests at once on a 32-block cache (256 tokens), prefix caching on:
    four plain ones of 100 tokens each leave no room, so sequences are preempted mid-grammar."""
    engine = make_engine(tiny_loaded, num_gpu_blocks=32, max_model_len=128, prefix_caching=True)
    mid_grammar = []  # structured requests preempted with part of their answer generated

    def watch(engine: LLMEngine, event) -> None:
        for rid in event.scheduler_outputs.preempted:
            group = engine._groups.get(rid)
            if group is not None and group.sampling_params.guided_decoding is not None and \
                    any(s.get_output_len() for s in group.get_seqs()):
                mid_grammar.append(rid)

    engine.add_callback(watch)
    with ServerThread(create_app(engine, model_name="tiny")) as server:
        structured = [("/v1/chat/completions", chat(response_format=json_schema_format(n, SCHEMAS[n])), SCHEMAS[n])
                      for n in ("refs", "object_array", "nested", "const_and_pattern")]
        structured += [("/v1/completions", completion(guided_json=SCHEMAS[n], temperature=1.0, n=2, seed=3),
                        SCHEMAS[n]) for n in ("string_and_integer", "refs")]
        structured.append(("/v1/completions", completion(guided_regex=REGEXES[1]), REGEXES[1]))
        plain = [("/v1/completions", completion(prompt=f"{PROMPT} {i}", max_tokens=90, ignore_eos=True), None)
                 for i in range(4)]
        jobs = structured + plain
        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(lambda job: ok(post(server, job[0], job[1])), jobs))
        assert engine.num_preemptions_total > 0 and mid_grammar
        for (path, body, check), answer in zip(jobs, answers):
            texts = texts_of(answer)
            if check is None:
                assert answer["usage"]["completion_tokens"] == 90
                continue
            for text, c in zip(texts, answer["choices"]):
                assert c["finish_reason"] == "stop"
                if isinstance(check, str):
                    assert re.fullmatch(check, text), text
                else:
                    jsonschema.validate(json.loads(text), check)
            # Preempted or not, the answer is the engine's own, alone and unhurried.
            ids = reference_ids(server, HELLO) if path.endswith("chat/completions") else \
                copy.deepcopy(server.server.config.app.state.tokenizer).encode(body["prompt"])
            guided = GuidedDecodingParams(regex=check) if isinstance(check, str) else GuidedDecodingParams(json=check)
            assert offline_texts(reference, ids, temperature=body["temperature"], n=body.get("n", 1),
                                 seed=body.get("seed"), max_tokens=MAX_TOKENS, guided_decoding=guided) == texts


# -- what the client asked for, and cannot be met: 400s, never the server's 500 ----------------------

@pytest.mark.parametrize("case", ["grammar against allowed ids", "min_tokens against allowed ids"])
def test_constraints_that_leave_no_token_are_the_clients_400(served, case):
    tokenizer = served.server.config.app.state.tokenizer
    if case == "grammar against allowed ids":  # a digit is all the grammar allows, a letter all the ids
        fields = {"guided_regex": "[0-9]", "allowed_token_ids": tokenizer.encode("x")}
    else:  # EOS is the only token allowed, and min_tokens bans it
        fields = {"allowed_token_ids": [tokenizer.eos_token_id], "min_tokens": 2}
    error = error_of(post(served, "/v1/completions", completion(**fields)))
    assert error["code"] == "constraints_unsatisfiable" and "the request's constraints" in error["message"], error
    assert ok(post(served, "/v1/completions", completion(max_tokens=2)))["choices"]  # and it goes on serving


@pytest.mark.parametrize("function,param", [
    ({"name": "get weather"}, "tools.0.function.name"),  # OpenAI's names: letters, digits, _ and -
    ({"name": "f", "parameters": {"type": "string"}}, "tools.0.function.parameters"),
])
def test_tools_follow_openais_rules_for_names_and_parameters(served, function, param):
    body = chat(tools=[{"type": "function", "function": function}], tool_choice=named(function["name"]))
    assert error_of(post(served, "/v1/chat/completions", body))["param"] == param
