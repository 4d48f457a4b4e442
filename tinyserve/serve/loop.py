"""The engine loop: one background task that steps the engine while requests come and go.

HTTP handlers never call ``engine.step()``. They add their request (between two steps, under
the loop's lock) and read their own queue. The loop steps the engine in a single worker thread,
so the event loop stays free to accept connections while the model runs, and routes each
``RequestOutput`` to the queue of its request. Aborts are only noted by the handler and carried
out by the loop before its next step, so the engine is never touched by two threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tinyserve.engine import LLMEngine
from tinyserve.sequence import SamplingParams


class EngineLoop:
    """Steps the engine in the background and routes each request's outputs to its queue."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()  # held while the engine steps or a request is added
        self._queues: dict[str, asyncio.Queue] = {}
        self._to_abort: set[str] = set()
        self._wake = asyncio.Event()
        self._stopping = False
        # One thread: steps never overlap, and the tokenizer is never used from two threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-engine")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def run_locked(self, fn, *args):
        """Run ``fn`` on the engine thread between two steps (tokenizing, adding a request)."""
        async with self.lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Add a request to the engine; its outputs will arrive on the returned queue."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            await self.run_locked(self.engine.add_request, request_id, None, params, prompt_token_ids)
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Synchronous on purpose: it is called from cancelled handlers, which cannot await."""
        if self._queues.pop(request_id, None) is not None:
            self._to_abort.add(request_id)
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._wake.clear()
            async with self.lock:
                if self._to_abort:
                    self.engine.abort_request(sorted(self._to_abort))
                    self._to_abort.clear()
                if not self.engine.has_unfinished_requests():
                    outputs = None
                else:
                    try:
                        outputs = await loop.run_in_executor(self._executor, self.engine.step)
                    except Exception as e:  # a failed step fails every request in flight
                        self.engine.abort_request(list(self._queues))
                        for queue in self._queues.values():
                            queue.put_nowait(e)
                        self._queues.clear()
                        continue
            if outputs is None:
                await self._wake.wait()
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finished:
                        del self._queues[out.request_id]
            await asyncio.sleep(0)  # let handlers read their outputs and new requests take the lock

    async def stop(self) -> None:
        """Finish the current step, then abort whatever is left (freeing its blocks)."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self.engine.abort_request(list(self._queues) + sorted(self._to_abort))
        for queue in self._queues.values():  # nobody waits forever on a stopped loop
            queue.put_nowait(RuntimeError("the server is shutting down"))
        self._queues.clear()
        self._executor.shutdown(wait=True)
