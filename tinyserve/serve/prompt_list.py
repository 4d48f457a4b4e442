"""A list of prompts in one ``/v1/completions`` request (OpenAI's and vLLM's way): each prompt is a
request of its own in the engine, all added between the same two steps so they are scheduled
together (``EngineLoop.add_many``: if the engine refuses one, none is added, and the 400 names
the prompt), and the answer is one: ``choices`` indexed prompt by prompt, then sample by
sample (prompt i's sample j is choice ``i * n + j``), usage summed over the prompts.

A plain answer waits for every prompt's last output, and is built and encoded off the event
loop (``jsonbody.json_answer``, as a single prompt's); a streamed one interleaves the prompts'
chunks as they come (each prompt's own ``stream_events``, with the choice indices shifted and
the id made the request's), sends one usage chunk with the sums, then ``data: [DONE]``. An
error before the first token of any prompt aborts them all and is the HTTP error; a client that
goes away, or stops reading a stream, has every prompt aborted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from tinyserve.engine import RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.serve.bodies import APIError
from tinyserve.serve.choices import ChoiceFormat
from tinyserve.serve.jsonbody import json_answer
from tinyserve.serve.loop import EngineLoop, RequestRefused
from tinyserve.serve.mailbox import Mailbox
from tinyserve.serve.protocol import CompletionRequest, field_named, output_error, usage
from tinyserve.serve.streaming import StallGuardedStream, stream_events


@dataclass
class Prompt:
    """One prompt of the list, ready for the engine: its ids, its params, how its choices are written."""

    ids: list[int]
    params: SamplingParams
    fmt: ChoiceFormat


async def respond_to_list(request: Request, loop: EngineLoop, request_id: str, prompts: list[Prompt],
                          body: CompletionRequest, name: str, stall_timeout_s: float):
    """The answer to a completions request with several prompts (see the module's docstring)."""
    ids = [f"{request_id}-{i}" for i in range(len(prompts))]

    def abort_all() -> None:
        for rid in ids:
            loop.abort(rid)

    for p in prompts:
        p.params.output_kind = "delta" if body.stream else "final_only"
    # All in one go, between two steps (EngineLoop.add_many): the engine schedules them together,
    # and a prompt it refuses leaves none of them in. Cancelled, add_many aborts them once in.
    try:
        boxes: list[Mailbox] = await loop.add_many([(rid, p.ids, p.params) for rid, p in zip(ids, prompts)])
    except RequestRefused as e:  # the engine's own checks on one prompt
        message = f"prompt {e.index}: {e}"
        raise APIError(message, param=field_named(str(e)) or f"prompt.{e.index}") from None
    created = int(time.time())
    firsts = await _all_or_none(request, abort_all, [box.get() for box in boxes])
    if firsts is None:
        return JSONResponse({}, status_code=499)  # nobody is listening
    for out in firsts:
        if isinstance(out, Exception) or (out.finished and out.error):
            abort_all()
            raise _error(out)
    if body.stream:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        streams = [stream_events(loop, rid, box, first, p.params, created, p.fmt, name, include_usage, continuous)
                   for rid, box, first, p in zip(ids, boxes, firsts, prompts)]
        events = _merged(streams, {"id": request_id, "object": "text_completion", "created": created, "model": name},
                         body.n, include_usage)
        return StallGuardedStream(events, stall_timeout_s, on_stall=abort_all, media_type="text/event-stream")
    finals = await _all_or_none(request, abort_all, [_last(box, first) for box, first in zip(boxes, firsts)])
    if finals is None:
        return JSONResponse({}, status_code=499)
    for out in finals:
        if isinstance(out, Exception) or out.error:
            abort_all()
            raise _error(out)

    def answer() -> dict:
        # As a single prompt's plain answer (app._respond): built and encoded off the event loop,
        # the choices one at a time (jsonbody.py), for n prompts x n samples with logprobs run to
        # megabytes too.
        totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for out, p in zip(finals, prompts):
            for key, value in usage(out, p.fmt.completion_tokens(out)).items():
                totals[key] += value
        choices = ({**p.fmt.choice(out, c), "index": i * body.n + c.index}
                   for i, (out, p) in enumerate(zip(finals, prompts)) for c in out.outputs)
        return {"id": request_id, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": totals}

    return await json_answer(answer)


def _error(out: RequestOutput | Exception) -> APIError:
    if isinstance(out, Exception):
        return APIError(f"the engine failed: {out}", status=500, type_="server_error")
    return output_error(out)


async def _last(box: Mailbox, out: RequestOutput | Exception) -> RequestOutput | Exception:
    """A request's final output (its mailbox holds whole snapshots: the last is the answer)."""
    while isinstance(out, RequestOutput) and not out.finished:
        out = await box.get()
    return out


async def _all_or_none(request: Request, abort_all, waits: list) -> list | None:
    """The results of ``waits``, or None (every prompt aborted) if the client goes away first."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gathered = asyncio.ensure_future(asyncio.gather(*waits))
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not gathered.done():
        gathered.cancel()
        abort_all()
        return None
    return gathered.result()


async def _merged(streams: list[AsyncIterator[str]], head: dict, n: int, include_usage: bool) -> AsyncIterator[str]:
    """The prompts' event streams as one: chunks as they come, re-indexed, one usage at the end
    (``head``: the fields every chunk starts with)."""
    queue: asyncio.Queue = asyncio.Queue()
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

    async def pump(i: int, events: AsyncIterator[str]) -> None:
        try:
            async for event in events:
                queue.put_nowait((i, event))
        finally:
            await events.aclose()  # its finally aborts the request if it did not finish
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, event = await queue.get()
            if event is None:
                running -= 1
                continue
            if event == "data: [DONE]\n\n":
                continue
            chunk = json.loads(event.removeprefix("data: "))
            if "error" in chunk:
                yield event
                continue
            if not chunk["choices"] and chunk.get("usage"):  # a prompt's closing usage: summed instead
                for key in totals:
                    totals[key] += chunk["usage"][key]
                continue
            chunk["id"] = head["id"]
            for choice in chunk["choices"]:
                choice["index"] += i * n
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': totals})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()  # the client went away: each prompt's stream aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)
