"""OpenAI's wire format: request bodies and their limits, the error body, usage and errors of answers.

Request bodies are pydantic models with OpenAI's field names. Unknown fields are refused at
every level (in a message and in ``stream_options`` too), so a typo is an error rather than a
silently ignored setting; every field has a strict type (``"4"`` is not a number, ``true`` is
not 1) and a range: a value outside it is a 400 naming the field before the engine ever sees
the request (one bad request must never reach a step that all the others share). Every field of
OpenAI's chat and completions requests is known: implemented, accepted as a no-op when it never
changes the answer (``store``, ``metadata``, ``service_tier``, ``user``, ``parallel_tool_calls``,
``prediction``), or refused by name when it would change the answer and is not implemented
(``UNIMPLEMENTED``: any value but the ones that ask for nothing is a 400 naming the field).
docs/serving_fields.md lists them all, with vLLM's extras. ``usage`` and ``output_error`` read an
answer's token counts and the error a finished request is answered with; the streamed chunks are
``streaming.py``'s.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from tinyserve.constraints import UNSATISFIABLE
from tinyserve.engine import RequestOutput
from tinyserve.guided_params import GuidedDecodingParams
from tinyserve.sequence import SamplingParams
from tinyserve.serve.bodies import APIError
from tinyserve.serve.structured import ResponseFormat, Tool, ToolChoice

log = logging.getLogger("tinyserve.serve")

# Dividing logits by a temperature this small overflows float32 to inf, and the softmax to NaN.
TEMPERATURE_FLOOR = 1e-5
MAX_SEED = 2**63 - 1  # torch generators take a signed 64-bit seed
MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
MAX_N = 16
MAX_PROMPTS = 1024  # prompts in one completions request (each is a request of its own in the engine)
# OpenAI's limits: completions return at most 5 top logprobs per token, chat at most 20.
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20
MAX_PROMPT_LOGPROBS = 20  # vLLM's prompt_logprobs: the engine's own bound (sampling_params.MAX_LOGPROBS)
# OpenAI's bounds on ``metadata``: 16 pairs, keys of at most 64 characters, values of 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MetadataKey = Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)]
MetadataValue = Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)]

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)]

# Strict types: an int is not a bool nor a string of digits, a float is a number (an int will do)
# but not a string, a bool is true or false, a list of token ids holds ints. Lax parsing would
# read "no" as True and [true, false] as the prompt [1, 0]: a client's mistake must be a 400.
# allow_inf_nan: Python's json module reads NaN and Infinity, which no range check catches.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a usage chunk before ``data: [DONE]``) and vLLM's
    ``continuous_usage_stats`` (with it, every chunk carries the counts so far; guidellm asks
    for it)."""

    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = True  # OpenAI pads streamed chunks against side channels: a no-op here


class SamplingFields(BaseModel):
    """The fields both endpoints share: the model's name and how to sample."""

    model_config = STRICT

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: StopList | None = None  # one string is read as a list of one
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as OpenAI writes it, a string) -> [-100, 100]
    # No-ops: they ask OpenAI to store, label, bill or cache the request, never for other tokens.
    user: str | None = None
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras: how the prompt is tokenized (None: the endpoint's default), which of its
    # tokens are kept, and the prompt's own logprobs.
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    # Constraints (chapter 12): a token mask, words to avoid, and a shape for the output
    # (structured.py turns the last five into the engine's grammar).
    allowed_token_ids: Annotated[list[int], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, StringConstraints(min_length=1)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Refused by name unless off (UNIMPLEMENTED): the engine's detokenizer always skips special tokens.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Beam search (chapter 14), as v0.4's server took it: the width is best_of (n when unset).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    top_k: int = Field(-1, ge=-1)  # extensions, as vLLM offers them; the vocabulary bounds top_k
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds | None = None
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    include_stop_str_in_output: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        if 0 < value < TEMPERATURE_FLOOR:
            raise ValueError(f"must be 0 (greedy) or at least {TEMPERATURE_FLOOR:g}, got {value!r}")
        return value


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT32)  # 0 only with echo: score the prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None


class FunctionCall(BaseModel):
    """The function an assistant called: its name and its arguments, as a JSON string (OpenAI's)."""

    model_config = STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message in the history."""

    model_config = STRICT

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message, with OpenAI's fields. Its content is a string or a list of text parts
    (``chat_messages`` reads them); an assistant's may be null when it made ``tool_calls``, and a
    ``tool`` message answers the call ``tool_call_id`` names. All of it goes to the chat template."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages only
    tool_call_id: str | None = None  # tool messages only, and required there
    refusal: str | None = None  # an assistant's refusal, passed to the template as sent


# OpenAI's (and vLLM's) fields that tinyserve does not implement, each with the values that ask
# for nothing (what a client sends to mean "off"): any other value is a 400 naming the field.
UNIMPLEMENTED = {
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
}
UNIMPLEMENTED_COMPLETION_FIELDS = {"suffix": (None,)}
UNIMPLEMENTED_CHAT_FIELDS = {
    "functions": (None,), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "reasoning_effort": (None,), "verbosity": (None,),
    "web_search_options": (None,), "documents": (None,), "chat_template": (None,),
}
# Why each is refused, for the error message.
WHY_REFUSED = {
    "functions": "it is OpenAI's deprecated form of tools: send tools and tool_choice",
    "function_call": "it is OpenAI's deprecated form of tool_choice: send tools and tool_choice",
    "skip_special_tokens": "the engine's detokenizer always skips special tokens",
    "spaces_between_special_tokens": "the engine's detokenizer always skips special tokens",
    "chat_template": "the server renders the model's own chat template only",
    "modalities": "the model writes text only",
    "audio": "the model writes text only",
}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs: true
    # vLLM's: how the messages are rendered with the chat template.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # No-ops: one call at a time is all the model makes anyway; a predicted output only speeds up
    # OpenAI's answer, never changes it.
    parallel_tool_calls: bool | None = None
    prediction: dict | None = None
    tools: list[Tool] | None = None  # with a named or "required" tool_choice (structured.py)
    tool_choice: ToolChoice | None = None
    # Any JSON value: reject_unsupported refuses all but UNIMPLEMENTED_CHAT_FIELDS' "off" values.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    documents: Any = None
    chat_template: Any = None


# apply_chat_template's own arguments: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})


def reject_unsupported(body: SamplingFields) -> None:
    """Refuse, by name, the OpenAI and vLLM parameters tinyserve does not implement, unless they
    ask for nothing (an empty ``logit_bias``, ``tool_choice: "none"``)."""
    fields = dict(UNIMPLEMENTED)
    fields.update(UNIMPLEMENTED_CHAT_FIELDS if isinstance(body, ChatCompletionRequest)
                  else UNIMPLEMENTED_COMPLETION_FIELDS)
    for name, off in fields.items():
        if not _is_one_of(getattr(body, name), off):
            why = WHY_REFUSED.get(name, "it is not implemented")
            raise APIError(f"{name} is not supported by tinyserve ({why}); leave it out", param=name)
    if isinstance(body, ChatCompletionRequest) and body.stream and body.tool_choice == "required":
        raise APIError('tool_choice "required" is not available when streaming (the calls are read from the whole '
                       'answer): set stream to false, or name the function', param="tool_choice")
    if body.use_beam_search and body.stream:
        raise APIError("use_beam_search is not available when streaming: which beams win is known only at the end",
                       param="use_beam_search")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError("prompt_logprobs are not available when streaming (as in vLLM)", param="prompt_logprobs")
    echo_k = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    if echo_k is not None and body.prompt_logprobs is not None and echo_k != body.prompt_logprobs:
        raise APIError(f"prompt_logprobs={body.prompt_logprobs} and echo with logprobs={echo_k} ask for the prompt's "
                       "logprobs twice: they must be the same k", param="prompt_logprobs")
    if isinstance(body, ChatCompletionRequest):
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt: false (the answer continues the "
                           "last message rather than starting a new one)", param="continue_final_message")
        if body.continue_final_message and body.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs the last message to be the assistant's",
                           param="continue_final_message")
        reserved = sorted(set(body.chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(f"chat_template_kwargs may not set {reserved[0]!r} (a field of the request, or of the "
                           "renderer itself)", param=f"chat_template_kwargs.{reserved[0]}")


def _is_one_of(value, allowed: tuple) -> bool:
    # By type as well as value: 0 == False and 1 == True in Python, but not in JSON.
    return any(type(value) is type(a) and value == a for a in allowed)


def drop_unknown_fields(data: dict, model: type[BaseModel]) -> list[str]:
    """Remove from a parsed body the fields ``model`` does not know (top level, in a chat message
    and in ``stream_options``), and return their names (``--ignore-unknown-fields``, vLLM's way)."""
    dropped = _drop(data, model, "")
    # Any body with chat messages (a chat completion, a chat /tokenize).
    if "messages" in model.model_fields and isinstance(data.get("messages"), list):
        for i, message in enumerate(data["messages"]):
            if isinstance(message, dict):
                dropped += _drop(message, ChatMessage, f"messages.{i}.")
    if "stream_options" in model.model_fields and isinstance(data.get("stream_options"), dict):
        dropped += _drop(data["stream_options"], StreamOptions, "stream_options.")
    return dropped


def _drop(data: dict, model: type[BaseModel], prefix: str) -> list[str]:
    unknown = [key for key in data if key not in model.model_fields]
    for key in unknown:
        del data[key]
    return [prefix + key for key in unknown]


def check_ranges(body: SamplingFields, vocab_size: int, max_num_seqs: int) -> None:
    """The ranges that depend on each other or on the served engine (pydantic checks the rest)."""
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of < body.n:
        raise APIError(f"best_of must be at least n={body.n}, got {best_of}", param="best_of")
    samples, name = (body.n, "n") if best_of is None else (best_of, "best_of")
    if samples > max_num_seqs:
        raise APIError(f"{name}={samples} is more than this server runs at once (max_num_seqs={max_num_seqs})",
                       param=name)
    if body.seed is not None and body.seed + samples - 1 > MAX_SEED:
        # Sample i of a request draws from seed + i: every one of them must be a valid seed.
        raise APIError(f"seed must be in [0, {MAX_SEED - samples + 1}] with {name}={samples} (sample i uses "
                       f"seed + i, and seeds end at 2**63-1), got {body.seed}", param="seed")
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and body.logprobs is not True:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
        raise APIError("max_tokens must be at least 1 (0 is allowed with echo: true, to score the prompt alone)",
                       param="max_tokens")
    if body.top_k != -1 and not 1 <= body.top_k <= vocab_size:
        raise APIError(f"top_k must be -1 (every token) or in [1, {vocab_size}] (the vocabulary), got {body.top_k}",
                       param="top_k")
    if any(not 0 <= t < vocab_size for t in body.stop_token_ids or []):
        raise APIError(f"stop_token_ids must be token ids in [0, {vocab_size})", param="stop_token_ids")
    if any(not 0 <= t < vocab_size for t in body.allowed_token_ids or []):
        raise APIError(f"allowed_token_ids must be token ids in [0, {vocab_size})", param="allowed_token_ids")
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(f"logit_bias keys must be token ids in [0, {vocab_size}), written as strings, got {key!r}",
                           param="logit_bias")
        if not -100 <= bias <= 100:
            raise APIError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}", param="logit_bias")


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them, with text content only.

    A content part that is not text (an image, audio) cannot be read by a text-only model; it is
    refused rather than dropped, so the answer never silently ignores part of the question. A
    tool call's arguments go to the template as a dict when they are a JSON object (as vLLM
    passes them: templates such as Llama 3.1's write them with ``tojson``), else as sent."""
    rendered = []
    for i, m in enumerate(messages):
        _check_tool_fields(m, i)
        content = m.content
        if content is None:
            if m.role != "assistant":
                raise APIError(f"a {m.role} message needs content", param=f"messages.{i}.content")
            content = ""
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                kind = part.get("type")
                if kind != "text":
                    raise APIError(f"content parts of type {kind!r} are not supported: tinyserve serves a text-only "
                                   "model, so only {'type': 'text', 'text': ...} parts are accepted",
                                   param=f"{where}.type")
                if not isinstance(part.get("text"), str):
                    raise APIError("a text content part needs a string `text`", param=f"{where}.text")
                unknown = sorted(set(part) - {"type", "text"})
                if unknown:
                    raise APIError(f"unknown field in a text content part: {unknown[0]!r} (a text part has only "
                                   "`type` and `text`)", param=f"{where}.{unknown[0]}")
                pieces.append(part["text"])
            content = "".join(pieces)
        message = {"role": m.role, "content": content}
        for field in ("name", "tool_call_id", "refusal"):
            if getattr(m, field) is not None:
                message[field] = getattr(m, field)
        if m.tool_calls is not None:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        rendered.append(message)
    return rendered


def _check_tool_fields(m: ChatMessage, i: int) -> None:
    if m.tool_calls is not None and m.role != "assistant":
        raise APIError(f"messages.{i}: only an assistant message has tool_calls, not a {m.role} message",
                       param=f"messages.{i}.tool_calls")
    if m.role == "tool" and m.tool_call_id is None:
        raise APIError(f"messages.{i}: a tool message needs the tool_call_id of the call it answers",
                       param=f"messages.{i}.tool_call_id")
    if m.role != "tool" and m.tool_call_id is not None:
        raise APIError(f"messages.{i}: only a tool message has a tool_call_id, not a {m.role} message",
                       param=f"messages.{i}.tool_call_id")
    if m.refusal is not None and m.role != "assistant":
        raise APIError(f"messages.{i}: only an assistant message has a refusal, not a {m.role} message",
                       param=f"messages.{i}.refusal")


def _arguments(arguments: str):
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def to_sampling_params(body: SamplingFields, max_tokens: int,
                       guided: GuidedDecodingParams | None = None) -> SamplingParams:
    """The engine's SamplingParams for a request; its ValueErrors become 400s naming the field.

    Completions' ``logprobs: k`` asks for k per output token, and with ``echo`` for the prompt's
    too; chat's ``logprobs: true`` for ``top_logprobs`` (0 if unset). ``max_tokens=0`` with echo
    generates one token, which the answer drops (as vLLM v0.4 does)."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs, best_of = body.prompt_logprobs, None
    else:
        logprobs, best_of = body.logprobs, body.best_of
        prompt_logprobs = logprobs if body.echo and logprobs is not None else body.prompt_logprobs
    try:
        return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              max_tokens=max(max_tokens, 1), stop=body.stop, stop_token_ids=body.stop_token_ids,
                              ignore_eos=body.ignore_eos, seed=body.seed, best_of=best_of,
                              presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                              min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              include_stop_str_in_output=body.include_stop_str_in_output,
                              logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
                              allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words or None,
                              guided_decoding=guided, use_beam_search=body.use_beam_search,
                              length_penalty=body.length_penalty, early_stopping=body.early_stopping)
    except ValueError as e:
        raise APIError(str(e), param=field_named(str(e))) from None


def field_named(message: str) -> str | None:
    """The SamplingParams field an error message is about (it names the field, usually first)."""
    fields = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop_token_ids",
              "stop", "ignore_eos", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "logprobs", "prompt_logprobs", "include_stop_str_in_output", "logit_bias", "allowed_token_ids",
              "bad_words", "use_beam_search", "length_penalty", "early_stopping")
    words = [w.strip("`'\":,.=()") for w in message.replace("=", " ").split()]
    return next((w for w in words if w in fields), None)


def usage(out: RequestOutput, completion_tokens: int | None = None) -> dict:
    """OpenAI's token counts for a request (a stream counts its completion tokens as they go)."""
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion_tokens,
            "total_tokens": len(out.prompt_token_ids) + completion_tokens}


def output_error(out: RequestOutput) -> APIError:
    """The HTTP error for a request the engine finished with an error.

    The engine's reason names the server's settings (block counts, swap space), which are the
    operator's business: it is logged, and the client gets what it can act on. A request that
    can never fit, whatever else runs, is a 400: it asked too much. One the engine had to give
    up while others held the memory (``retryable``) is the server's failure, a 503 to retry.
    Anything else is the engine failing on the request (a 500)."""
    log.warning("request %s ended with an error: %s", out.request_id, out.error)
    if out.error and UNSATISFIABLE in out.error:
        # The request's own constraints (a grammar, allowed_token_ids, bad_words, min_tokens) left
        # no token to draw, or a grammar outgrew its bounds: the client's request, not the server.
        return APIError(f"this request's constraints cannot be met: {out.error}", code="constraints_unsatisfiable")
    if out.retryable:
        return APIError("The server ran out of memory for this request while serving others, and had to stop it. "
                        "Retry it later.", status=503, type_="server_error", code="server_overloaded")
    if any(c.finish_reason in ("ignored", "length") for c in out.outputs):  # "length": compat="vllm-0.4"
        return APIError("This request can never fit in this server's KV cache: its prompt, n samples and max_tokens "
                        "need more memory at once than the server has. Lower n or max_tokens, or shorten the "
                        "prompt.", code="request_cannot_fit")
    return APIError(f"the engine failed on this request: {out.error}", status=500, type_="server_error")
