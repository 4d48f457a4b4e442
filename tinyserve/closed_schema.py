"""JSON schemas with their objects closed: no properties beyond those the schema names.

By JSON Schema's own rule an object that does not say ``additionalProperties`` takes any other
key, and llguidance follows the rule: a small model asked for ``{"city": ...}`` may go on adding
``"country"``, ``"weather"`` ... until ``max_tokens`` (seen with LangChain's ``bind_tools``, which
sends tools that way). vLLM's default grammar backend, xgrammar, compiles schemas in its strict
mode, where such keys are not allowed, and OpenAI's strict mode requires ``additionalProperties:
false`` on every object. So tinyserve closes every object that lists ``properties`` and says
nothing about the others; an object that says ``additionalProperties`` (or
``unevaluatedProperties``) keeps what it says, and one without ``properties`` (``{"type":
"object"}``, json_object mode) stays open.
"""

from __future__ import annotations

import copy

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
       "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: dict) -> dict:
    """A copy of ``schema`` with ``"additionalProperties": false`` on every object schema that
    lists ``properties`` and says nothing of other keys (iteratively: depth is the client's)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false are schemas too
        if "properties" in node and "additionalProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        for key in ONE:
            value = node.get(key)
            if isinstance(value, list):  # "items" as a list: the older tuple form
                stack.extend(value)
            elif isinstance(value, dict):
                stack.append(value)
        for key in MANY:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in NAMED:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
    return schema
