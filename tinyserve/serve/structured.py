"""Structured output over HTTP: ``response_format``, vLLM's ``guided_*`` fields, and tools.

Each becomes one ``GuidedDecodingParams`` (the engine's grammar, chapter 12):

- ``response_format``: ``{"type": "json_object"}`` any JSON object; ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` JSON under the schema (enforced whether or not
  ``strict`` is set: the mask cannot do less); ``{"type": "text"}`` nothing.
- vLLM's ``guided_json`` (a schema, or its text), ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (a Lark grammar, llguidance's dialect).
- ``tools`` with ``tool_choice`` naming a function: the answer is that function's arguments, JSON
  under its ``parameters`` schema, returned as a tool call. With ``"required"``: a JSON list of
  ``{"name", "parameters"}`` calls of the listed functions (vLLM's format), each a tool call.
  ``"auto"`` (OpenAI's default when tools are given) needs a parser for the model's own tool-call
  format, which the default model has none of: it is refused by name. ``"none"`` asks for text.

A request may ask for one of them at most; two are a 400 naming the second.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.serve.bodies import APIError

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")  # OpenAI's key; "schema" is pydantic's own method
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict | None) -> dict | None:
        # Arguments are a JSON object (OpenAI's rule): a schema of anything else is refused.
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f"a function's parameters must be the JSON schema of an object, "
                             f"got type {value['type']!r}")
        return value


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# What a function without ``parameters`` takes: an object with any fields (OpenAI's reading).
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How the answer's text becomes tool calls: one call of ``name``, or a list (``required``)."""

    name: str | None  # the named function, or None for "required"

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls in a finished answer's text, or None when the text is not what the
        grammar was heading for (a ``max_tokens`` cut): then it is returned as content."""
        if self.name is not None:
            return [tool_call(self.name, text)]
        try:
            listed = json.loads(text)
        except ValueError:
            return None
        return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in listed]


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def guided_decoding(body, chat: bool) -> tuple[GuidedDecodingParams | None, ToolPlan | None, str | None]:
    """The grammar a request asks for (None for none), for tools how to read the answer, and the
    field that asked (for errors)."""
    asked: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema.schema",
                           param="response_format.json_schema")
        asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            asked.append((name, {kind: getattr(body, name)}))
    plan = None
    if chat:
        plan, schema = _tool_plan(body.tools, body.tool_choice)
        if plan is not None:
            asked.append(("tool_choice", {"json": schema}))
    if len(asked) > 1:
        raise APIError(f"{asked[1][0]} and {asked[0][0]} both constrain the output: ask for one", param=asked[1][0])
    if not asked:
        return None, None, None
    param, kind = asked[0]
    if param == "tool_choice":  # a grammar that does not compile is the function's parameters' fault
        names = [t.function.name for t in body.tools]
        param = "tools" if plan.name is None else f"tools.{names.index(plan.name)}.function.parameters"
    try:
        return GuidedDecodingParams(**kind), plan, param
    except ValueError as e:
        raise APIError(str(e), param=param) from None


def _tool_plan(tools: list[Tool] | None, choice) -> tuple[ToolPlan | None, dict | None]:
    if choice == "none" or (not tools and choice is None):
        return None, None
    if not tools:
        raise APIError("tool_choice needs tools to choose from", param="tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("two tools have the same function name", param="tools")
    if choice is None or choice == "auto":
        raise APIError('tool_choice "auto" is not supported: it needs a parser for the model\'s own tool-call '
                       'format, and this model has none. Name the function ({"type": "function", "function": '
                       '{"name": ...}}) or ask for "required"', param="tool_choice")
    if choice == "required":
        # Each schema moves from the root to items.anyOf, where its "#/$defs/..." references would
        # point at nothing: its definitions move to the root with it (vLLM's way).
        defs: dict = {}
        calls = []
        for t in tools:
            params = dict(t.function.parameters or ANY_OBJECT)
            for key in ("$defs", "definitions"):
                for def_name, schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, schema) != schema:
                        raise APIError(f"two tools define {key}/{def_name} differently", param="tools")
            calls.append({"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        return ToolPlan(None), {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
    wanted = choice.function.name
    for tool in tools:
        if tool.function.name == wanted:
            return ToolPlan(wanted), tool.function.parameters or ANY_OBJECT
    raise APIError(f"tool_choice names the function {wanted!r}, which is not among the tools ({', '.join(names)})",
                   param="tool_choice.function.name")


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's JSON), for the prompt."""
    return None if not tools else [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
