"""OpenAI's wire format: request bodies, the error body, and the streamed chunks.

Request bodies are pydantic models with OpenAI's field names. Unknown fields are refused, so a
typo is an error rather than a silently ignored setting. ``stream_events`` turns a request's
outputs into server-sent events: a chunk per new piece of text, each choice's finish_reason,
optionally the usage, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinyserve.engine import RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.serve.loop import EngineLoop


class SamplingFields(BaseModel):
    """The fields both endpoints share: the model's name and how to sample."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = Field(False, strict=True)  # lax parsing would take "no" for True
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    top_k: int = -1  # extensions, as vLLM offers them
    ignore_eos: bool = Field(False, strict=True)
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error body with the given HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def reject_unsupported(body: SamplingFields) -> None:
    """Refuse, by name, the OpenAI parameters tinyserve does not implement."""
    checks = [("presence_penalty", body.presence_penalty != 0), ("frequency_penalty", body.frequency_penalty != 0),
              ("logit_bias", bool(body.logit_bias)), ("logprobs", bool(body.logprobs)),
              ("echo", getattr(body, "echo", False)), ("suffix", getattr(body, "suffix", None) is not None),
              ("best_of", getattr(body, "best_of", None) not in (None, body.n))]
    for name, bad in checks:
        if bad:
            raise APIError(f"{name} is not supported by tinyserve", param=name)


def to_sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for a request; its ValueErrors become 400s naming the field."""
    try:
        return SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              max_tokens=max_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
                              ignore_eos=body.ignore_eos, seed=body.seed)
    except ValueError as e:  # SamplingParams names the field first
        raise APIError(str(e), param=str(e).split()[0]) from None


async def parse_body(request: Request, model: type[SamplingFields]) -> SamplingFields:
    """The request's JSON body as ``model``; anything wrong with it is a 400 naming the field."""
    try:
        data = json.loads(await request.body())
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def usage(out: RequestOutput) -> dict:
    """OpenAI's token counts for a request."""
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion}


def safe_text(text: str, finished: bool, holdback: int) -> str:
    """What of the text so far can be sent without taking it back later: not the last characters
    that might still become a stop string, nor a half-decoded character."""
    if finished:
        return text
    if holdback:
        text = text[: max(0, len(text) - holdback)]
    return text.rstrip("\ufffd")


async def stream_events(loop: EngineLoop, request_id: str, queue: asyncio.Queue, first: RequestOutput,
                        params: SamplingParams, created: int, chat: bool, name: str,
                        include_usage: bool = False) -> AsyncIterator[str]:
    """The server-sent events of one streamed request: a chunk per new piece of text of each
    choice (chat streams open with the role), one that carries each choice's finish_reason,
    optionally the usage, then ``data: [DONE]``."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    holdback = max((len(s) for s in params.stop), default=1) - 1
    sent: dict[int, str] = {}
    finished = False

    def event(choices: list[dict], usage: dict | None = None) -> str:
        chunk = {"id": request_id, "object": kind, "created": created, "model": name, "choices": choices}
        if include_usage:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    out: RequestOutput | Exception = first
    done: set[int] = set()  # choices whose last chunk (with its finish_reason) went out
    try:
        if chat:  # the first chunk of every choice announces the role
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(params.n)])
        while True:
            for c in out.outputs:
                if c.index in done:
                    continue
                old = sent.get(c.index, "")
                text = safe_text(c.text, c.finish_reason is not None, holdback)
                delta = text[len(old):] if text.startswith(old) else ""
                if delta or c.finish_reason is not None:
                    sent[c.index] = old + delta
                    if c.finish_reason is not None:
                        done.add(c.index)
                    piece = {"delta": {"content": delta}} if chat else {"text": delta, "logprobs": None}
                    yield event([{"index": c.index, **piece, "finish_reason": c.finish_reason}])
            if out.finished:
                break
            out = await queue.get()
            if isinstance(out, Exception):  # the engine loop already aborted the request
                err = {"message": f"the engine failed: {out}", "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': err})}\n\n"
                break
        finished = True
        if include_usage and isinstance(out, RequestOutput):
            yield event([], usage(out))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream (Starlette cancelled us): free its blocks
            loop.abort(request_id)
