"""A plain (non-streamed) JSON answer, built and encoded off the event loop and sent in pieces.

An answer with many samples and logprobs runs to megabytes: 16 choices of 450 tokens with 20
top logprobs each is 10 MB. Building its dicts, FastAPI's encoder and ``json.dumps`` once took
seconds on the event loop, and every other connection, ``/health`` included, waited. Here the
answer is built on a worker thread, and encoded there in pieces of about ``PIECE_VALUES`` JSON
values each: ``json.dumps`` is C that keeps the interpreter lock for a whole call, so one call on
10 MB would still hold the loop for a third of a second, while a piece takes a few milliseconds.
The bytes, exactly ``json.dumps(answer, ensure_ascii=False, allow_nan=False, separators=(",",
":"))`` as Starlette's ``JSONResponse`` writes them, go out with a Content-Length in chunks of
``CHUNK_BYTES``, each waiting for the client to take the one before (an unread answer is timed
by its connection, ``connections.TimedH11Protocol``).

A value may be a generator: ``app._respond`` makes the choices one at a time, each encoded and
dropped before the next. Hundreds of thousands of dicts and lists alive at once would make the
garbage collector walk the whole heap, the interpreter lock held for a tenth of a second or more,
and every thread, the event loop's included, would wait.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from types import GeneratorType

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

PIECE_VALUES = 4096  # JSON values in a container encoded whole: split past this (cheap to count)
PIECE_BYTES = 64 * 1024  # what one json.dumps call on a run of list items aims at: a millisecond or two
CHUNK_BYTES = 256 * 1024  # bytes handed to the connection at once


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _count(obj, cap: int) -> int:
    """How many JSON values ``obj`` holds (itself included), counting no further than past ``cap``."""
    n, stack = 0, [obj]
    while stack:
        x = stack.pop()
        n += 1
        if n > cap:
            break
        if isinstance(x, GeneratorType):  # not to be counted, nor encoded whole
            return cap + 1
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return n


def json_pieces(obj, piece_values: int = PIECE_VALUES, piece_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """``obj`` as JSON, in pieces that join to ``_dumps(obj)`` (a generator is written as the list
    of what it yields).

    A container of more than ``piece_values`` values is split: a dict value by value, a list
    into runs of items encoded together, each run as long as makes about ``piece_bytes`` by the
    runs before it (items are alike in an answer: tokens, choices), and an item that is itself
    big on its own. Counting every small item would cost more than encoding it; only the first
    of each run is counted."""
    if isinstance(obj, GeneratorType):  # items made one at a time, each encoded and dropped before the next
        yield "["
        for i, item in enumerate(obj):
            yield "," if i else ""
            yield from json_pieces(item, piece_values, piece_bytes)
        yield "]"
        return
    if _count(obj, piece_values) <= piece_values:
        yield _dumps(obj)
        return
    if isinstance(obj, dict):
        yield "{"
        for i, (key, value) in enumerate(obj.items()):
            # The key as json.dumps writes it (it turns 1, True and None into strings).
            yield ("," if i else "") + _dumps({key: None})[1:-6] + ":"
            yield from json_pieces(value, piece_values, piece_bytes)
        yield "}"
        return
    yield "["
    items, i, run = obj if isinstance(obj, list) else list(obj), 0, 1
    while i < len(items):
        sep = "," if i else ""
        if _count(items[i], piece_values) > piece_values:
            yield sep
            yield from json_pieces(items[i], piece_values, piece_bytes)
            i += 1
            continue
        piece = _dumps(items[i:i + run])[1:-1]
        yield sep + piece
        i += run
        run = max(1, min(2 * run, run * piece_bytes // max(1, len(piece))))
    yield "]"


def json_chunks(obj, chunk_bytes: int = CHUNK_BYTES) -> list[bytes]:
    """``obj``'s JSON as UTF-8, in chunks of about ``chunk_bytes`` (slow: run it off the loop)."""
    chunks, parts, size = [], [], 0
    for piece in json_pieces(obj):
        parts.append(piece)
        size += len(piece)
        if size >= chunk_bytes:
            chunks.append("".join(parts).encode("utf-8"))
            parts, size = [], 0
        # Let the event loop have the interpreter now if it waits for it, rather than at the
        # next switch interval: each wait would add to the latency of everything it serves.
        time.sleep(0)
    if parts:
        chunks.append("".join(parts).encode("utf-8"))
    return chunks


class ChunkedJSONResponse(Response):
    """A JSON response whose body is already encoded, sent chunk by chunk under one Content-Length."""

    media_type = "application/json"

    def __init__(self, chunks: list[bytes], status_code: int = 200) -> None:
        super().__init__(None, status_code=status_code)
        self.chunks = chunks
        self.headers["content-length"] = str(sum(len(c) for c in chunks))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i + 1 < len(self.chunks)})
        if not self.chunks:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def json_answer(build: Callable[[], dict]) -> ChunkedJSONResponse:
    """The answer ``build()`` makes, built and encoded on a worker thread, ready to send in chunks."""
    return ChunkedJSONResponse(await asyncio.to_thread(lambda: json_chunks(build())))
