"""Structured output through the whole engine: every output of a constrained request is what its
grammar describes, checked by libraries that know nothing of llguidance (``jsonschema`` for JSON
schemas, ``re`` for regexes, ``lark`` for Lark grammars), greedy and sampled, on the tiny random
model (whose unconstrained text is noise, so only the mask makes it valid) and on SmolLM2.

Then the grammar state under the engine's other machinery: a KV cache so small that requests are
preempted (swap and recompute, under every policy), prompts that share a prefix with prefix caching
on, prompts prefilled in chunks, constrained requests next to unconstrained ones. The reference is
each request run alone with room to spare: a greedy or seeded request must give the same tokens,
so the state a sequence's grammar stands in survived every preemption. And what the engine keeps
per request (grammar states, bad words) is gone once the request finishes or is aborted."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from tinyserve.config import POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from tinyserve.engine import LLMEngine
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.sampling_params import SamplingParams
from tinyserve.worker import Worker


def string(**kw) -> dict:
    return {"type": "string", **kw}


def obj(required: dict, optional: dict | None = None) -> dict:
    """An object with these properties (``required`` required) and no others."""
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required),
            "additionalProperties": False}


def integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


# Strings have a maxLength and objects no additional properties, so that a model with random
# weights, which would otherwise write one string forever, finishes within max_tokens.
SCHEMAS = {
    "flat": obj({"name": string(maxLength=6), "age": integer(0, 120), "ok": {"type": "boolean"}}),
    "nested": obj({"user": obj({"id": integer(1, 999),
                                "tags": {"type": "array", "items": string(maxLength=3), "maxItems": 2}})}),
    "array bounds": {"type": "array", "items": integer(-5, 5), "minItems": 2, "maxItems": 4},
    "enums": obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]}}),
    "const": obj({"v": {"const": "1.0"}, "k": {"const": 7}}),
    "number bounds": obj({"x": {"type": "number", "minimum": 0, "maximum": 1},
                          "y": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    "booleans and null": {"type": "array", "items": {"type": ["boolean", "null"]}, "minItems": 1, "maxItems": 3},
    "anyOf": {"anyOf": [integer(0, 9), string(maxLength=4), {"type": "null"}]},
    "oneOf": obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": integer(1, 9)}),
                                      obj({"kind": {"const": "square"}, "side": integer(1, 9)})]}}),
    "optional properties": obj({"a": integer(0, 9)}, {"b": string(maxLength=3), "c": {"type": "boolean"}}),
    "string patterns": obj({"code": string(pattern="^[A-Z]{2}-[0-9]{3}$"), "zip": string(pattern="^[0-9]{5}$")}),
    "formats date and time": obj({"d": string(format="date"), "t": string(format="time")}),
    "formats email uuid ipv4": obj({"e": string(format="email", maxLength=16), "u": string(format="uuid"),
                                    "ip": string(format="ipv4")}),
    "format date-time": obj({"at": string(format="date-time")}),
    "string lengths": obj({"s": string(minLength=2, maxLength=4)}),
    "$ref": {"$defs": {"pt": obj({"x": integer(0, 9), "y": integer(0, 9)})}, "type": "object",
             "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"],
             "additionalProperties": False},
    "prefixItems": {"type": "array", "prefixItems": [integer(0, 9), string(maxLength=3), {"type": "boolean"}],
                    "items": False},
    "array of objects": {"type": "array", "items": obj({"k": string(maxLength=2), "v": integer(0, 99)}),
                         "minItems": 1, "maxItems": 3},
    "nullable string": {"type": ["string", "null"], "maxLength": 5},
    "top-level enum": {"enum": ["alpha", "beta", "gamma delta"]},
    "top-level integer": integer(-100, 100),
    "multipleOf": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "json_object mode": {"type": "object"},  # asked for as json_object=True, validated as this schema
}
# llguidance's \d and \w are Unicode classes, as Python's are for a str pattern: re.fullmatch
# agrees with them; [0-9] is the way to ask for ASCII digits.
REGEXES = {
    "date": r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    "alternatives": r"(yes|no|maybe)",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    "decimal": r"-?[0-9]{1,3}(\.[0-9]{1,2})?",
    "hex colour": r"#[0-9a-f]{6}",
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "repeat": r"(ab|cd){2,4}",
    "unicode digits": r"\d{3}",
    "names": r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    "unicode word": r"\w{1,4}",
}
CHOICES = {
    "colours": ["red", "green", "blue sky"],
    "prefixes": ["a", "ab", "abc"],
    "lark's special characters": ["{", '"quoted"', "a|b", "x\ny", "back\\slash", "/regex/"],
    "non-ASCII": ["héllo ☃", "naïve"],
}
# Lark grammars in llguidance's dialect that the lark package parses as well (the reference).
GRAMMARS = {
    "greeting": 'start: greeting " " name "!"\ngreeting: "hello" | "hi"\nname: /[a-z]{1,6}/',
    "list": 'start: item (", " item)*\nitem: /[0-9]{1,2}/ | "x"',
    "recursive": 'start: expr\nexpr: atom | "(" expr " + " expr ")"\natom: /[0-9]/',
    "key value": 'start: pair ("; " pair)~0..2\npair: KEY "=" VALUE\nKEY: /[a-z]{1,4}/\nVALUE: /[0-9]{1,3}/',
}
CASES = ({f"json {k}": ("json", v) for k, v in SCHEMAS.items()}
         | {f"regex {k}": ("regex", v) for k, v in REGEXES.items()}
         | {f"choice {k}": ("choice", v) for k, v in CHOICES.items()}
         | {f"grammar {k}": ("grammar", v) for k, v in GRAMMARS.items()})
PROMPTS = ["Hello, my name is", "The life is"]


def guided(kind: str, spec) -> GuidedDecodingParams:
    if kind == "json" and spec == {"type": "object"}:
        return GuidedDecodingParams(json_object=True)
    return GuidedDecodingParams(**{kind: spec})


def check_json_layout(text: str) -> None:
    """The text is laid out as json.dumps lays it out: outside strings, no whitespace but the one
    space after each ',' and ':' (grammar.JSON_LAYOUT)."""
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"[,:](?! )", skeleton), text
    assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), text


def check_valid(kind: str, spec, text: str) -> None:
    """Raise unless ``text`` is what ``spec`` describes, by a checker independent of llguidance."""
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
        check_json_layout(text)
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    elif kind == "choice":
        assert text in spec, (spec, text)
    else:
        lark.Lark(spec).parse(text)


def make_engine(loaded, *, blocks=512, block_size=4, policy="vllm", mode=None, prefix=False, chunked=False,
                budget=None, max_num_seqs=256) -> LLMEngine:
    mc = ModelConfig(model=str(loaded.path), device="cpu", dtype="float32")
    return LLMEngine(mc, CacheConfig(block_size=block_size, num_gpu_blocks=blocks, num_cpu_blocks=256, watermark=0.0,
                                     enable_prefix_caching=prefix),
                     SchedulerConfig(max_num_batched_tokens=budget or 4096, max_num_seqs=max_num_seqs,
                                     max_model_len=min(192, blocks * block_size), policy=policy, preemption_mode=mode,
                                     enable_chunked_prefill=chunked),
                     executor=Worker(mc, attention_backend="torch-batched", loaded=loaded))


def run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    """Add the requests, step until all finish; their final outputs by request id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert not engine.has_unfinished_requests()
    return done


# -- every kind of grammar, greedy and sampled, in one batch -------------------------------------


@pytest.fixture(scope="module")
def batch(tiny_loaded) -> tuple[LLMEngine, dict]:
    """Every case at once: greedy on each prompt, and three seeded samples on each prompt."""
    engine = make_engine(tiny_loaded)
    requests = {}
    for name, (kind, spec) in CASES.items():
        for i, prompt in enumerate(PROMPTS):
            requests[f"{name}|greedy|{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=120,
                                                                     guided_decoding=guided(kind, spec)))
            requests[f"{name}|sampled|{i}"] = (prompt, SamplingParams(temperature=1.0, n=3, seed=i, max_tokens=120,
                                                                      guided_decoding=guided(kind, spec)))
    return engine, run(engine, requests)


@pytest.mark.parametrize("name", list(CASES))
def test_every_output_is_valid_greedy_and_sampled(batch, name):
    kind, spec = CASES[name]
    _, done = batch
    outputs = [(rid, c) for rid, o in done.items() if rid.split("|")[0] == name for c in o.outputs]
    assert len(outputs) == 2 * (1 + 3)
    for rid, c in outputs:
        assert done[rid].error is None, done[rid].error
        assert c.finish_reason == "stop", (rid, c.text)
        check_valid(kind, spec, c.text)


def test_the_batch_ran_every_sequence_and_kept_no_grammar_state(batch):
    engine, done = batch
    assert len(done) == 4 * len(CASES)
    assert engine.constraints._states == {} and engine.constraints._bad_words == {}
    assert len(SCHEMAS) >= 20 and len(REGEXES) + len(CHOICES) + len(GRAMMARS) >= 15


# -- with preemption and prefix caching in play --------------------------------------------------

SHARED = "You are a helpful assistant. Answer briefly and clearly. "
# The unconstrained requests arrive first, so that the constrained ones, last in, are the
# scheduler's victims when blocks run out.
MIXED = {  # request id: (prompt, kind of constraint, its spec, params): greedy and seeded, some unconstrained
    "free": (SHARED + "In a small village by the sea,", None, None, dict(temperature=0, ignore_eos=True)),
    "bad words": (SHARED + "Paging the KV cache", None, None,
                  dict(temperature=0.8, seed=2, ignore_eos=True, bad_words=["the", "is"],
                       logit_bias={30: 4.0, 31: -50.0})),
    "json": (SHARED + "Hello, my name is", "json", SCHEMAS["array of objects"], dict(temperature=0)),
    "fork": (SHARED + "0123456789 The quick brown fox", "json", SCHEMAS["enums"],
             dict(temperature=1.0, n=2, seed=9, max_tokens=28)),
    "json seeded": (SHARED + "The life is", "json", SCHEMAS["$ref"],
                    dict(temperature=0.9, seed=11)),
    "regex": (SHARED + "What is the capital of France?", "regex", r"([a-z]{2,5} ){5,7}[a-z]{1,4}\.",
              dict(temperature=0)),
    "grammar": (SHARED + "The future of AI is", "grammar",
                'start: pair ("; " pair)~3..5\npair: /[a-z]{2,4}/ "=" /[0-9]{1,3}/', dict(temperature=0.7, seed=5)),
    "choice": (SHARED + "List three colors:", "choice", CHOICES["colours"], dict(temperature=0)),
}


def mixed_request(rid: str) -> tuple[str, SamplingParams]:
    prompt, kind, spec, fields = MIXED[rid]
    return prompt, SamplingParams(**{"max_tokens": 60 if kind else 30, **fields},
                                  guided_decoding=guided(kind, spec) if kind else None)


# Every policy with each preemption mode it allows (v1 recomputes only).
PREEMPTION_CASES = [(policy, mode) for policy in POLICIES
                    for mode in (("recompute",) if policy == "v1" else ("recompute", "swap"))]


@pytest.fixture(scope="module")
def alone(tiny_loaded) -> dict:
    """Each request run by itself with room to spare: no preemption, no chunks, no prefix cache."""
    engine = make_engine(tiny_loaded)
    done = {}
    for rid in MIXED:
        done |= run(engine, {rid: mixed_request(rid)})
    assert engine.num_preemptions_total == 0
    return done


@pytest.mark.parametrize("policy,mode", PREEMPTION_CASES)
def test_grammar_state_survives_preemption_prefix_caching_and_chunks(tiny_loaded, alone, policy, mode):
    engine = make_engine(tiny_loaded, blocks=28, policy=policy, mode=mode, prefix=True, chunked=True, budget=16,
                         max_num_seqs=10)
    # Which constrained requests were preempted with tokens already out, and the prefix-cache hits.
    preempted_mid_output, cached = set(), []

    def watch(eng, event):
        for rid in event.scheduler_outputs.preempted + event.scheduler_outputs.swapped_out:
            if MIXED[rid][1] and any(s.get_output_len() > 0 for s in eng._groups[rid].get_seqs()):
                preempted_mid_output.add(rid)

    engine.add_callback(watch)
    count_cached = engine.scheduler._num_cached_tokens
    engine.scheduler._num_cached_tokens = lambda group: cached.append(count_cached(group)) or cached[-1]
    done = run(engine, {rid: mixed_request(rid) for rid in MIXED})
    assert engine.num_preemptions_total > 0 and len(preempted_mid_output) >= 2, preempted_mid_output
    assert max(cached) >= 8  # the shared prefix came from the cache
    for rid, want in alone.items():
        got = done[rid]
        assert got.error is None, got.error
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], rid
        _, kind, spec, _ = MIXED[rid]
        for c in got.outputs if kind else ():
            assert c.finish_reason == "stop", (rid, c.text)
            check_valid(kind, spec, c.text)
    assert engine.constraints._states == {} and engine.constraints._bad_words == {}


# -- what the engine keeps, forks, and a grammar that cannot be satisfied ------------------------


def test_states_and_bad_words_are_forgotten_when_requests_finish_or_are_aborted(tiny_loaded):
    engine = make_engine(tiny_loaded)
    params = SamplingParams(temperature=1.0, n=2, seed=0, max_tokens=60, bad_words=["is"],
                            guided_decoding=guided("json", SCHEMAS["flat"]))
    for rid in ("kept", "aborted", "also aborted"):
        engine.add_request(rid, "Hello, my name is", params)
    for _ in range(3):
        engine.step()
    # Mid-run: each of the six sequences has a grammar state, each request its bad words.
    assert len(engine.constraints._states) == 6 and len(engine.constraints._bad_words) == 3
    engine.abort_request(["aborted", "also aborted"])
    assert set(engine.constraints._bad_words) == {"kept"} and len(engine.constraints._states) == 2
    done = run(engine, {})
    assert all(c.finish_reason == "stop" for c in done["kept"].outputs)
    assert engine.constraints._states == {} and engine.constraints._bad_words == {}


def test_a_fork_gets_distinct_valid_outputs(tiny_loaded):
    # n=3 samples one row at the prompt, then forks: each child gets a grammar state of its own.
    engine = make_engine(tiny_loaded)
    schema = SCHEMAS["flat"]
    params = SamplingParams(temperature=1.0, n=3, seed=4, max_tokens=80, guided_decoding=guided("json", schema))
    out = run(engine, {"fork": ("Hello, my name is", params)})["fork"]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) == 3, texts
    for c in out.outputs:
        assert c.finish_reason == "stop"
        check_valid("json", schema, c.text)
    assert engine.constraints._states == {}


def test_min_tokens_beyond_what_the_grammar_allows_fails_that_request_alone(tiny_loaded):
    engine = make_engine(tiny_loaded)
    done = run(engine, {
        "stuck": ("The life is", SamplingParams(temperature=0, min_tokens=12, max_tokens=20,
                                                guided_decoding=guided("choice", ["yes", "no"]))),
        "neighbour": ("The life is", SamplingParams(temperature=0, max_tokens=30,
                                                    guided_decoding=guided("json", SCHEMAS["enums"]))),
    })
    stuck = done["stuck"]
    assert stuck.error is not None and "constraints" in stuck.error and "min_tokens" in stuck.error
    assert stuck.outputs[0].finish_reason == "abort" and stuck.outputs[0].text in ("yes", "no")
    neighbour = done["neighbour"]
    assert neighbour.error is None and neighbour.outputs[0].finish_reason == "stop"
    check_valid("json", SCHEMAS["enums"], neighbour.outputs[0].text)
    assert engine.constraints._states == {}


def test_schemas_that_differ_only_in_property_order_are_different_grammars(tiny_loaded):
    # The properties come out in the schema's order; a compiled grammar shared between two
    # schemas that differ only in it would write the second one's in the first one's order.
    engine = make_engine(tiny_loaded)
    a_b = obj({"a": integer(0, 9), "b": integer(0, 9)})
    b_a = {**obj({"b": integer(0, 9), "a": integer(0, 9)}), "required": ["a", "b"]}
    for rid, schema in (("a_b", a_b), ("b_a", b_a), ("a_b again", a_b)):
        done = run(engine, {rid: ("The life is", SamplingParams(temperature=0, max_tokens=30,
                                                                guided_decoding=guided("json", schema)))})
        assert list(json.loads(done[rid].outputs[0].text)) == list(schema["properties"]), rid


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_answers_a_schema_with_valid_json(smollm2_loaded):
    schema = obj({"city": string(maxLength=20), "country": string(maxLength=20),
                  "population_millions": {"type": "number", "minimum": 0, "maximum": 50}})
    engine = make_engine(smollm2_loaded, block_size=16, blocks=64)
    prompt = ("<|im_start|>user\nGive the capital of France as JSON with keys city, country and "
              "population_millions.<|im_end|>\n<|im_start|>assistant\n")
    done = run(engine, {"capital": (prompt, SamplingParams(temperature=0, max_tokens=60,
                                                           guided_decoding=guided("json", schema)))})
    out = done["capital"].outputs[0]
    assert out.finish_reason == "stop", out.text
    check_valid("json", schema, out.text)
    assert json.loads(out.text)["city"] == "Paris"
