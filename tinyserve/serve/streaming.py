"""A streamed answer: server-sent events from a request's delta outputs, and a response that
gives up on a client that stops reading.

A stream asks the engine for deltas (``SamplingParams(output_kind="delta")``): each output holds
only what is new, and the engine already held back text that could still become a stop string,
so every piece can be sent as it comes. ``stream_events`` turns them into OpenAI's chunks: one
per new piece of each choice (chat streams open with the role), one carrying each choice's
finish_reason, optionally the usage, then ``data: [DONE]``. A chunk carries the logprobs of its
tokens when the request asks for them, and a completion with ``echo`` opens each choice with the
prompt (with its logprobs, once the prompt has been computed).

A client that stops reading fills the socket's buffers, and then every write waits.
``StallGuardedStream`` bounds that wait (``ServerSettings.stall_timeout_s``): a write that has
not gone out in time aborts the request, which frees its blocks, and closes the connection.
Meanwhile the engine goes on: the request's outputs merge in its mailbox, never one per step.
(A plain answer, all produced before it is sent, is timed by its connection instead, with the
same timeout: ``connections.TimedH11Protocol``.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from tinyserve.engine import RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.serve.bodies import APIError
from tinyserve.serve.choices import ChoiceFormat
from tinyserve.serve.loop import EngineLoop
from tinyserve.serve.mailbox import Mailbox
from tinyserve.serve.protocol import output_error, usage

log = logging.getLogger("tinyserve.serve")


async def stream_events(loop: EngineLoop, request_id: str, mailbox: Mailbox, first: RequestOutput,
                        params: SamplingParams, created: int, fmt: ChoiceFormat, name: str,
                        include_usage: bool = False, continuous_usage: bool = False) -> AsyncIterator[str]:
    """The server-sent events of one streamed request, from its delta outputs. A request the
    engine fails or gives up on midway ends with an error event (OpenAI's error body) before
    ``[DONE]``. With ``include_usage`` the last chunk before it carries the usage, and with
    ``continuous_usage`` too every chunk the counts so far (others carry ``"usage": null``)."""
    chat = fmt.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    num_tokens = dict.fromkeys(range(params.n), 0)  # per choice, for the usage
    to_echo = set(range(params.n)) if fmt.echo is not None else set()
    text_offsets = dict.fromkeys(range(params.n), 0)  # per choice, for completions' text_offset
    finished = False

    def event(choices: list[dict], totals: dict | None = None) -> str:
        chunk = {"id": request_id, "object": kind, "created": created, "model": name, "choices": choices}
        if include_usage:
            chunk["usage"] = totals if totals is not None or not continuous_usage else \
                usage(first, sum(num_tokens.values()))
        return f"data: {json.dumps(chunk)}\n\n"

    out: RequestOutput | Exception = first
    try:
        if chat:  # the first chunk of every choice announces the role
            yield event([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                         for i in range(params.n)])
        while True:
            for c in out.outputs:
                num_tokens[c.index] = num_tokens.get(c.index, 0) + (0 if fmt.echo_only else len(c.token_ids))
                # The echo waits for the prompt's logprobs (a chunked prefill reports before they exist).
                echo = c.index in to_echo and (fmt.top is None or out.prompt_logprobs is not None)
                text, ids, entries = fmt.text_and_entries(out, c, with_echo=echo)
                if echo or text or c.finish_reason is not None or (fmt.top is not None and ids):
                    to_echo.discard(c.index)
                    logprobs = fmt.logprobs(ids, entries, text_offsets[c.index])
                    if fmt.texts is not None:  # offsets count token texts, as the whole answer's do
                        text_offsets[c.index] += sum(len(fmt.texts[t]) for t in ids)
                    piece = fmt.piece(c.index, text)
                    yield event([{"index": c.index, **piece, "logprobs": logprobs, "finish_reason": c.finish_reason}])
            if out.finished:
                if out.error:
                    yield f"data: {json.dumps(output_error(out).body())}\n\n"
                break
            out = await mailbox.get()
            if isinstance(out, Exception):  # the engine loop already aborted the request
                err = APIError(f"the engine failed: {out}", status=500, type_="server_error")
                yield f"data: {json.dumps(err.body())}\n\n"
                break
        finished = True
        if include_usage and isinstance(out, RequestOutput):
            yield event([], usage(out, sum(num_tokens.values())))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away mid-stream (Starlette cancelled us): free its blocks
            loop.abort(request_id)


class ClientStalled(Exception):
    """A write to the client did not go out within the stall timeout."""


class StallGuardedStream(StreamingResponse):
    """A streaming response whose every write must go out within ``stall_timeout_s``; when one
    does not, ``on_stall()`` runs (the handler aborts the request) and the connection is closed."""

    def __init__(self, content: AsyncIterator[str], stall_timeout_s: float, on_stall: Callable[[], None],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.stall_timeout_s, self.on_stall = stall_timeout_s, on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def guarded(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.stall_timeout_s)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await super().__call__(scope, receive, guarded)
        except Exception as e:
            if not _is_stall(e):
                raise
            log.warning("aborted a stream whose client read nothing for %.0f s", self.stall_timeout_s)
            self.on_stall()
            await _close_generator(self.body_iterator)
            # Returning with the response unfinished makes uvicorn close the connection.


def _is_stall(e: BaseException) -> bool:
    """A ClientStalled, alone or inside the exception groups a task group raises."""
    if isinstance(e, ClientStalled):
        return True
    inner = getattr(e, "exceptions", None)
    return bool(inner) and all(_is_stall(x) for x in inner)


async def _close_generator(gen) -> None:
    """Run the events generator's ``finally`` now rather than whenever it is collected."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()
