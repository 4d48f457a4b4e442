"""Objects of a JSON schema are closed as vLLM's default backend (xgrammar's strict mode) closes
them: a key the schema does not name is not allowed unless the schema says it is."""

from __future__ import annotations

import json

import pytest

from tinyserve.closed_schema import close_objects
from tinyserve.grammar import GrammarCompiler
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.models.tiny import make_tiny_tokenizer


def test_objects_with_properties_are_closed_at_every_depth_and_nothing_else_changes():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key named "properties"
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "list": {"type": "array", "items": {"properties": {"z": {}}}},
        "any": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]},
        "free": {"type": "object"},
    }, "$defs": {"d": {"properties": {"q": {}}, "unevaluatedProperties": True}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]  # a map of names, not a schema
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["any"]["anyOf"][0]["additionalProperties"] is False and props["any"]["anyOf"][1] == {"type": "string"}
    assert props["free"] == {"type": "object"}  # no properties listed: json_object's shape stays open
    assert "additionalProperties" not in closed["$defs"]["d"]
    assert "additionalProperties" not in schema  # the client's schema is not touched


@pytest.fixture(scope="module")
def compiler():
    tok = make_tiny_tokenizer()
    return GrammarCompiler(tok, len(tok), tok.eos_token_id), tok


def accepts(compiler, schema: dict, document: dict) -> bool:
    grammars, tok = compiler
    state = grammars.matcher(GuidedDecodingParams(json=schema))
    text = json.dumps(document)  # the compact layout the grammar writes
    try:
        state.sync(tok.encode(text) + [tok.eos_token_id])
    except ValueError:
        return False
    return True


def test_the_grammar_refuses_keys_the_schema_does_not_name(compiler):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    assert accepts(compiler, schema, {"city": "Paris"})
    assert not accepts(compiler, schema, {"city": "Paris", "country": "France"})
    opened = {**schema, "additionalProperties": True}
    assert accepts(compiler, opened, {"city": "Paris", "country": "France"})
    assert accepts(compiler, {"type": "object"}, {"anything": 1})  # json_object's schema stays open
