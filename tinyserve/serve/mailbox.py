"""Where the engine loop leaves a request's outputs until its handler takes them.

The loop must never wait for a client, and a client that reads slowly must not make the server
keep one output per step. A ``Mailbox`` holds one request's untaken outputs merged into one:
for the delta outputs a stream asks for (``SamplingParams(output_kind="delta")``) the new pieces
of text and token ids are appended, so however far behind a reader falls, it holds at most the
request's own output, once. A failure (the engine's, or the server stopping) is delivered after
what was already produced.
"""

from __future__ import annotations

import asyncio

from tinyserve.outputs import CompletionOutput, RequestOutput


class Mailbox:
    """One request's outputs not yet taken by its handler, merged."""

    def __init__(self, delta: bool) -> None:
        self.delta = delta  # outputs are deltas (their pieces add up) rather than whole snapshots
        self._latest: RequestOutput | None = None  # the newest output, for everything but the pieces
        self._texts: dict[int, list[str]] = {}  # choice index -> pieces of text not yet taken
        self._ids: dict[int, list[int]] = {}  # choice index -> token ids not yet taken
        self._logprobs: dict[int, list[dict] | None] = {}  # choice index -> their logprobs, if asked for
        self._cumulative: dict[int, float] = {}
        self._reasons: dict[int, str | None] = {}
        self._error: Exception | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        """Add the engine's next output: a delta's pieces add to those not yet taken, a whole
        output replaces them."""
        if not self.delta:
            self._texts, self._ids, self._logprobs = {}, {}, {}
        for c in out.outputs:
            self._texts.setdefault(c.index, []).append(c.text)
            self._ids.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self._logprobs.setdefault(c.index, []).extend(c.logprobs)
            self._reasons[c.index] = c.finish_reason
            self._cumulative[c.index] = c.cumulative_logprob
        self._latest = out
        self._ready.set()

    def fail(self, error: Exception) -> None:
        """The request will produce nothing more: ``get`` returns ``error`` once the rest is taken."""
        self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput | Exception:
        """What arrived since the last call (waiting for something if nothing did)."""
        await self._ready.wait()
        if self._latest is None:
            return self._error
        out = self._latest
        out.outputs = [CompletionOutput(i, "".join(self._texts[i]), self._ids[i], self._reasons[i],
                                        self._cumulative[i], self._logprobs.get(i))
                       for i in sorted(self._texts)]
        self._latest, self._texts, self._ids, self._reasons = None, {}, {}, {}
        self._logprobs, self._cumulative = {}, {}
        if self._error is None:
            self._ready.clear()
        return out
