"""A request's body before anything expensive is done with it: its size limits, reading it, and
the OpenAI error body every refusal is sent as.

A body is checked on its way in: one over the size limit is a 413 without being kept, one that
is not JSON (or is nested too deeply for the parser, or holds a lone UTF-16 surrogate that no
tokenizer can encode) or does not fit the endpoint's model is a 400 naming the field, and a
prompt that could never fit is refused by its length in characters, before it is tokenized.
Decoding a large body takes time in proportion to its size, so it runs on a worker thread,
never on the event loop that every other connection shares.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

# Above this many bytes a body is parsed and validated on a worker thread (below it, the thread
# hop costs more than the work).
OFF_LOOP_BYTES = 64 * 2**10
# A lone surrogate can only come from a \uD800-\uDFFF escape: UTF-8 cannot encode one.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with lone surrogates written as escapes: an error message that quotes the client's
    input must still encode as UTF-8, or the error itself becomes a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error body with the given HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None) -> None:
        message, param = printable(message), None if param is None else printable(param)
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers or self.headers)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may weigh before anything expensive (tokenizing) is done with it.

    No token covers more characters than the longest entry of the vocabulary, so a prompt of
    more than ``max_model_len`` times that many characters can never fit: it is refused without
    being tokenized. The body limit follows: JSON spends at most 12 bytes on one character (an
    escaped surrogate pair), plus room for everything around the prompt.
    """

    max_model_len: int
    chars_per_token: int
    max_prompt_chars: int
    max_body_bytes: int

    @classmethod
    def for_tokenizer(cls, tokenizer, max_model_len: int, max_body_bytes: int | None = None) -> RequestLimits:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
        per_token = max(16, longest)  # generous: real text averages about 4 characters a token
        chars = max_model_len * per_token
        return cls(max_model_len, per_token, chars, max_body_bytes or 12 * chars + 2**20)

    def check_prompt_chars(self, num_chars: int, param: str, at_least: bool = False) -> None:
        """Refuse a prompt of more characters than could ever fit (``at_least``: the count is an
        estimate from below, made before the prompt was rendered)."""
        if num_chars > self.max_prompt_chars:
            count = f"at least {num_chars}" if at_least else str(num_chars)
            raise APIError(f"The prompt has {count} characters, more than this server accepts "
                           f"({self.max_prompt_chars} characters: the model's maximum context length is "
                           f"{self.max_model_len} tokens, of at most {self.chars_per_token} characters each), so it "
                           "could never fit. "
                           "Shorten the prompt.", param=param, code="context_length_exceeded")


MAX_DRAIN_BYTES = 64 * 2**20


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body; one over ``max_bytes`` is a 413.

    Nothing past the limit is kept, but it is read to the end (up to ``MAX_DRAIN_BYTES``): a
    server that answers before the client has sent its body closes a connection with unread
    data, and the client sees a reset instead of the 413."""
    too_large = APIError(f"The request body is larger than this server accepts ({max_bytes} bytes).",
                         status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes + MAX_DRAIN_BYTES:
        raise too_large  # not worth reading at all
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes + MAX_DRAIN_BYTES:
            break
        if size <= max_bytes:
            chunks.append(chunk)
    if size > max_bytes:
        raise too_large
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int,
                     before: Callable[[dict], None] | None = None) -> BaseModel:
    """The request's JSON body as ``model``; anything wrong with it is a 400 naming the field.

    ``before`` looks at the parsed JSON before the model is validated: a cheap check (how many
    messages) that refuses a body whose validation would be long work for nothing."""
    raw = await read_body(request, max_bytes)
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode, raw, model, before)
    return decode(raw, model, before)


def decode(raw: bytes, model: type[BaseModel], before: Callable[[dict], None] | None = None) -> BaseModel:
    """``raw`` parsed as JSON and validated as ``model`` (see ``parse_body``)."""
    try:
        data = json.loads(raw)
    except RecursionError:  # the parser recurses once per [ or {
        raise APIError("the request body is nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or a number of more than 4300 digits
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    if before is not None:
        before(data)
    if SURROGATE_ESCAPE.search(raw):
        check_no_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise invalid_fields(e.errors()) from None


def check_no_lone_surrogates(data: dict) -> None:
    """Refuse a string (or a key) holding half of a UTF-16 surrogate pair, naming where it is.

    JSON can spell one (``"\\ud800"``) and Python's parser keeps it, but it is not a character:
    no tokenizer encodes it and no UTF-8 text (an answer, a log line) can hold it. The walk is
    iterative because the parser allows more nesting than Python's recursion would."""
    stack: list[tuple[object, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, (*path, key))
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(text: str, path: tuple) -> None:
    found = None if text.isascii() else SURROGATE.search(text)
    if found:
        param = ".".join(map(str, path)) or None
        raise APIError(f"{param or 'the body'}: the text holds a lone UTF-16 surrogate (\\u{ord(found[0]):04x}) at "
                       f"character {found.start()}, which is not a character; send UTF-8 text or a complete "
                       "surrogate pair", param=param)


def invalid_fields(errors: list[dict]) -> APIError:
    """The 400 for pydantic's (or FastAPI's) validation errors: the first one, naming its field."""
    if not errors:
        return APIError("the request body is not valid")
    err = errors[0]
    param = ".".join(str(p) for p in err.get("loc", ()) if not _is_union_branch(p)) or None
    msg = str(err.get("msg", "is not valid")).removeprefix("Value error, ")
    return APIError(f"{param}: {msg}" if param else msg, param=param)


def _is_union_branch(part: str | int) -> bool:
    """Pydantic names the member of a union that failed ("str", "list[int]") in an error's
    location; the client wants the field's path."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in {"str", "int", "float", "bool", "dict"})
