"""OpenAI's wire format: request bodies and their limits, the error body, usage and errors of answers.

Request bodies are pydantic models with OpenAI's field names. Unknown fields are refused at
every level (in a message and in ``stream_options`` too), so a typo is an error rather than a
silently ignored setting; every field has a strict type (``"4"`` is not a number, ``true`` is
not 1) and a range: a value outside it is a 400 naming the field before the engine ever sees
the request (one bad request must never reach a step that all the others share). OpenAI fields
tinyserve does not implement are refused by name unless they ask for nothing. ``usage`` and ``output_error`` read an
answer's token counts and the error a finished request is answered with; the streamed chunks are
``streaming.py``'s.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from tinyserve.engine import RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.serve.bodies import APIError

log = logging.getLogger("tinyserve.serve")

# Dividing logits by a temperature this small overflows float32 to inf, and the softmax to NaN.
TEMPERATURE_FLOOR = 1e-5
MAX_SEED = 2**63 - 1  # torch generators take a signed 64-bit seed
MAX_INT32 = 2**31 - 1
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
MAX_N = 16
# OpenAI's limits: completions return at most 5 top logprobs per token, chat at most 20.
MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20

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
    logit_bias: dict[str, float] | None = None
    user: str | None = None
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


class ChatMessage(BaseModel):
    """One message. Its content is a string or a list of text parts (``chat_messages`` reads them);
    other OpenAI message fields (``name``, ``tool_calls``) are refused as unknown."""

    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


# OpenAI's chat fields that tinyserve does not implement, each with the values that ask for
# nothing (what a client sends to mean "off"): any other value is a 400 naming the field.
UNIMPLEMENTED_CHAT_FIELDS = {
    "tools": (None,), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None,), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
}


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs: true
    # Any JSON value: reject_unsupported refuses all but UNIMPLEMENTED_CHAT_FIELDS' "off" values.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


def reject_unsupported(body: SamplingFields) -> None:
    """Refuse, by name, the OpenAI parameters tinyserve does not implement, unless they ask for
    nothing (an empty ``logit_bias``, ``tool_choice: "none"``)."""
    checks = [("logit_bias", bool(body.logit_bias)), ("suffix", getattr(body, "suffix", None) is not None)]
    if isinstance(body, ChatCompletionRequest):
        checks += [(name, not _is_one_of(getattr(body, name), off)) for name, off in UNIMPLEMENTED_CHAT_FIELDS.items()]
    for name, bad in checks:
        if bad:
            raise APIError(f"{name} is not supported by tinyserve", param=name)


def _is_one_of(value, allowed: tuple) -> bool:
    # By type as well as value: 0 == False and 1 == True in Python, but not in JSON.
    return any(type(value) is type(a) and value == a for a in allowed)


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


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them, with text content only.

    A content part that is not text (an image, audio) cannot be read by a text-only model; it is
    refused rather than dropped, so the answer never silently ignores part of the question."""
    rendered = []
    for i, m in enumerate(messages):
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
        rendered.append({"role": m.role, "content": content})
    return rendered


def to_sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a request; its ValueErrors become 400s naming the field.

    Completions' ``logprobs: k`` asks for k per output token, and with ``echo`` for the prompt's
    too; chat's ``logprobs: true`` for ``top_logprobs`` (0 if unset). ``max_tokens=0`` with echo
    generates one token, which the answer drops (as vLLM v0.4 does)."""
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs, best_of = None, None
    else:
        logprobs, best_of = body.logprobs, body.best_of
        prompt_logprobs = logprobs if body.echo else None
    try:
        return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              max_tokens=max(max_tokens, 1), stop=body.stop, stop_token_ids=body.stop_token_ids,
                              ignore_eos=body.ignore_eos, seed=body.seed, best_of=best_of,
                              presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                              repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                              min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              include_stop_str_in_output=body.include_stop_str_in_output)
    except ValueError as e:
        raise APIError(str(e), param=field_named(str(e))) from None


def field_named(message: str) -> str | None:
    """The SamplingParams field an error message is about (it names the field, usually first)."""
    fields = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "stop_token_ids",
              "stop", "ignore_eos", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "logprobs", "prompt_logprobs", "include_stop_str_in_output")
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
    if out.retryable:
        return APIError("The server ran out of memory for this request while serving others, and had to stop it. "
                        "Retry it later.", status=503, type_="server_error", code="server_overloaded")
    if any(c.finish_reason in ("ignored", "length") for c in out.outputs):  # "length": compat="vllm-0.4"
        return APIError("This request can never fit in this server's KV cache: its prompt, n samples and max_tokens "
                        "need more memory at once than the server has. Lower n or max_tokens, or shorten the "
                        "prompt.", code="request_cannot_fit")
    return APIError(f"the engine failed on this request: {out.error}", status=500, type_="server_error")
