"""The engine loop: one background task that steps the engine while requests come and go.

HTTP handlers never call ``engine.step()``. They add their request (between two steps, under
the loop's lock; a list of prompts all at once, or none of them, with ``add_many``) and read
their own ``Mailbox``. The loop steps the engine in a single worker
thread, so the event loop stays free to accept connections while the model runs, and leaves each
``RequestOutput`` in the mailbox of its request, where untaken outputs are merged: a handler
that falls behind holds one merged output, never one per step. Aborts are only noted by the handler and carried
out by the loop before its next step, so the engine is never touched by two threads at once.

A step that fails because of one request finishes that request with an error (the engine says
which); a step that fails for no known request fails the requests in flight, and the loop goes
on serving the ones that come later. After everything it does with the engine, the loop takes a
snapshot of the engine's queues and blocks for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from tinyserve.engine import LLMEngine, RequestOutput
from tinyserve.sequence import SamplingParams
from tinyserve.serve.latency import RequestLatencies
from tinyserve.serve.mailbox import Mailbox
from tinyserve.serve.metrics import EngineStats, snapshot

log = logging.getLogger("tinyserve.serve")


class RequestRefused(ValueError):
    """The engine refused request ``index`` of an ``add_many`` (none of them was added)."""

    def __init__(self, index: int, error: ValueError) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


class EngineLoop:
    """Steps the engine in the background and leaves each request's outputs in its mailbox."""

    def __init__(self, engine: LLMEngine, latencies: RequestLatencies | None = None) -> None:
        self.engine = engine
        self.latencies = latencies  # observed for /metrics, if given
        if latencies is not None:
            engine.add_callback(latencies.stepped)
        self.lock = asyncio.Lock()  # held while the engine steps or a request is added
        self.stats: EngineStats = snapshot(engine)  # the latest, for /metrics
        self._mailboxes: dict[str, Mailbox] = {}
        self._to_abort: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        # One thread: steps never overlap. (The server tokenizes elsewhere, with its own tokenizer.)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-engine")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def run_locked(self, fn, *args):
        """Run ``fn`` on the engine thread between two steps."""
        async with self.lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
            finally:
                self.stats = snapshot(self.engine)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Mailbox:
        """Add a request to the engine; its outputs will arrive in the returned mailbox."""
        adding = asyncio.ensure_future(self._add(request_id, prompt_token_ids, params))
        try:
            # Shielded: a cancelled handler must not leave the lock while the engine thread adds.
            return await asyncio.shield(adding)
        except asyncio.CancelledError:
            # Nobody will read the request's outputs: abort it once it is in.
            adding.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(request_id))
            raise

    async def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Mailbox:
        mailbox = Mailbox(delta=params.output_kind == "delta")
        async with self.lock:  # registered under the lock too, so no step sees the request without it
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self.engine.add_request, request_id, None, params, prompt_token_ids)
            self._mailboxes[request_id] = mailbox
            if self.latencies is not None:
                self.latencies.added(request_id)
            self.stats = snapshot(self.engine)
        self._wake.set()
        return mailbox

    async def add_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> list[Mailbox]:
        """Add several requests (``(request_id, prompt_token_ids, params)`` each) between the same
        two steps, so the engine schedules them together; their mailboxes, in order.

        All or nothing: if the engine refuses one (a ValueError), the ones added before it are
        taken out again before any step, and ``RequestRefused`` says which it was."""
        adding = asyncio.ensure_future(self._add_many(items))
        try:
            return await asyncio.shield(adding)  # as in add: the lock is never left mid-add
        except asyncio.CancelledError:
            def abort_all(f: asyncio.Future) -> None:
                if not (f.cancelled() or f.exception()):
                    for request_id, _, _ in items:
                        self.abort(request_id)
            adding.add_done_callback(abort_all)
            raise

    async def _add_many(self, items: list[tuple[str, list[int], SamplingParams]]) -> list[Mailbox]:
        mailboxes = [Mailbox(delta=params.output_kind == "delta") for _, _, params in items]
        async with self.lock:
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self._add_all, items)
            finally:
                self.stats = snapshot(self.engine)
            for (request_id, _, _), mailbox in zip(items, mailboxes):
                self._mailboxes[request_id] = mailbox
                if self.latencies is not None:
                    self.latencies.added(request_id)
        self._wake.set()
        return mailboxes

    def _add_all(self, items: list[tuple[str, list[int], SamplingParams]]) -> None:
        """On the engine thread: add every request, or none (those added are aborted again)."""
        added: list[str] = []
        try:
            for index, (request_id, prompt_token_ids, params) in enumerate(items):
                try:
                    self.engine.add_request(request_id, None, params, prompt_token_ids)
                except ValueError as e:
                    raise RequestRefused(index, e) from e
                added.append(request_id)
        except BaseException:
            if added:
                self.engine.abort_request(added)
            raise

    def abort(self, request_id: str) -> None:
        """Synchronous on purpose: it is called from cancelled handlers, which cannot await."""
        if self._mailboxes.pop(request_id, None) is not None:
            self._to_abort.add(request_id)
            if self.latencies is not None:
                self.latencies.dropped(request_id)
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._wake.clear()
            outputs: list[RequestOutput] | None = None
            async with self.lock:
                try:
                    if self._to_abort:
                        self.engine.abort_request(sorted(self._to_abort))
                        self._to_abort.clear()
                    if self.engine.has_unfinished_requests():
                        outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception as e:  # no one request to blame: fail those in flight, serve the next
                    log.exception("an engine step failed; failing the %d requests in flight", len(self._mailboxes))
                    self._fail_in_flight(e)
                    outputs = []
                self.stats = snapshot(self.engine)
            if outputs is None:
                await self._wake.wait()
                continue
            for out in outputs:
                mailbox = self._mailboxes.get(out.request_id)
                if mailbox is not None:
                    mailbox.put(out)
                    if out.finished:
                        del self._mailboxes[out.request_id]
            await asyncio.sleep(0)  # let handlers read their outputs and new requests take the lock

    def _fail_in_flight(self, error: Exception) -> None:
        """Abort every request the engine holds and hand ``error`` to each one's handler."""
        sched = self.engine.scheduler
        in_engine = [g.request_id for q in (sched.waiting, sched.running, sched.swapped) for g in q]
        try:
            self.engine.abort_request(in_engine + sorted(self._to_abort))
        except Exception:
            log.exception("aborting the failed requests failed too")
        self._to_abort.clear()
        for request_id, mailbox in self._mailboxes.items():
            mailbox.fail(error)
            if self.latencies is not None:
                self.latencies.dropped(request_id)
        self._mailboxes.clear()

    async def stop(self) -> None:
        """Finish the current step, then abort whatever is left (freeing its blocks)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self.engine.abort_request(list(self._mailboxes) + sorted(self._to_abort))
        for mailbox in self._mailboxes.values():  # nobody waits forever on a stopped loop
            mailbox.fail(RuntimeError("the server is shutting down"))
        self._mailboxes.clear()
        self.stats = snapshot(self.engine)
        if self.latencies is not None:
            self.engine.remove_callback(self.latencies.stepped)
        self._executor.shutdown(wait=True)
