"""A request's body before anything expensive is done with it: its size limits, reading it, and
the OpenAI error body every refusal is sent as.

A body is checked on its way in: one over the size limit is a 413 without being kept, one that
is not JSON or does not fit the endpoint's model is a 400 naming the field, and a prompt that
could never fit is refused by its length in characters, before it is tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error body with the given HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(f"The prompt has {num_chars} characters, more than this server accepts "
                           f"({self.max_prompt_chars} characters: max_model_len={self.max_model_len} tokens of at "
                           f"most {self.chars_per_token} characters each), so it could never fit. "
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


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int) -> BaseModel:
    """The request's JSON body as ``model``; anything wrong with it is a 400 naming the field."""
    try:
        data = json.loads(await read_body(request, max_bytes))
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"] if not _is_union_branch(p)) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(f"{param}: {msg}" if param else msg, param=param) from None


def _is_union_branch(part: str | int) -> bool:
    """Pydantic names the member of a union that failed ("str", "list[int]") in an error's
    location; the client wants the field's path."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in {"str", "int", "float", "bool", "dict"})
