"""An asyncio engine loop over continuous batching, for servers:

    loop = EngineLoop(engine, max_batch=8)
    request = loop.submit("ROMEO:", max_new_tokens=64, temperature=0.8, seed=1)   # checks now
    async for piece in request:           # Piece(ids=(id,), text): confirmed tokens only, in order (a
                                          # last Piece(ids=(), text) carries text held back to the end)
        print(piece.text, end="")
    request.result                        # GenerationResult: ids, text (stop strings cut), stats
    request.finish_reason                 # "eos" | "stop_string" | "max_new_tokens" | "cancelled"
    loop.cancel(request)                  # from anywhere; its pool row is freed at the next step boundary

The loop belongs to the event loop of its first submit (a later asyncio.run takes it over once that one
has closed, cancelling what was left of it). submit may be called from another thread too (its request
is then iterated on the loop's event loop, e.g. through asyncio.run_coroutine_threadsafe).

One task drives the scheduler: each iteration runs one BatchScheduler.step in a worker thread (the
event loop stays free), then hands the confirmed tokens to each request's queue. It sleeps while no
request is waiting or running and wakes on submit. Text follows the single-sequence stream's rule
(detokenize.IncrementalText.take_settled): no incomplete UTF-8 character, no text that may begin a stop
string; each token decodes a few ids, not the whole output. A sequence whose own work fails in a step
(its grammar, its sampling) ends alone with its error (Sequence.error) and the step goes on for the
others (Sequence.fail_alone). A step that fails (a backend error) ends every request it was
running with that error (those that had already ended, end as they did); waiting requests stay queued
and the loop carries on. A request
whose KV cache cannot be allocated even alone ends with OutOfMemory; the others are unaffected.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from speedc.runtimes.batch import BatchScheduler
from speedc.runtimes.sequence import DONE, Sequence
from speedc.runtimes.detokenize import Piece
from speedc.runtimes.engine import Engine, GenerationResult
from speedc.runtimes.heap import return_freed_memory


class Submitted:
    """Async iterator of one request's Pieces; `result` and `finish_reason` once it has ended."""

    def __init__(self, engine: Engine, sequence: Sequence, stop: list[str] | None) -> None:
        self.engine, self.sequence, self.stop = engine, sequence, stop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.result: GenerationResult | None = None
        self._text = engine.incremental_text(stop) if engine.tokenizer is not None else None
        self._delivered = 0  # tokens handed to the queue so far
        self.error: BaseException | None = None  # the failure that ended it, if one did

    @property
    def finish_reason(self) -> str | None:
        return self.result.stats.stop_reason if self.result else None

    @property
    def ids(self) -> list[int]:
        return list(self.sequence.out)

    def _deliver(self, token: int | None) -> None:
        """Called on the event loop, in order: the next confirmed token, or None: finished."""
        if token is None:
            text = None  # the whole text, stop strings cut: one whole decode, exactly generate()'s
            if self._text is not None:
                text = self.engine.trim(self.engine.decode_text(self.sequence.out), self.stop)
                rest = self._text.take_rest(text)
                if rest:
                    self.queue.put_nowait(Piece(ids=(), text=rest))  # held-back text (never a new id)
            self.result = GenerationResult(list(self.sequence.out), text, self.sequence.stats)
            self.queue.put_nowait(None)
            return
        self._delivered += 1
        piece = ""
        if self._text is not None:
            self._text.push(token)
            piece = self._text.take_settled()
        self.queue.put_nowait(Piece(ids=(token,), text=piece))

    def _end(self) -> None:
        """Called on the event loop when its sequence has ended: as it finished, or with why it could not run."""
        if self.sequence.error is not None:
            self._fail(self.sequence.error)
        else:
            self._deliver(None)

    def _fail(self, error: BaseException) -> None:
        """Called on the event loop: the step that ran this request failed; iterating raises ERROR."""
        self.error = error
        self.queue.put_nowait(None)

    def __aiter__(self) -> "Submitted":
        return self

    async def __anext__(self) -> Piece:
        item = await self.queue.get()
        if item is None:
            self.queue.put_nowait(None)  # iterating again ends at once
            if self.error is not None:
                raise self.error
            raise StopAsyncIteration
        return item

    async def wait(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.result


class EngineLoop:
    def __init__(self, engine: Engine, *, scheduler: BatchScheduler | None = None, **batch_options) -> None:
        """BATCH_OPTIONS: Engine.batch_scheduler's (max_batch, kv_cache_mb, row_budget, prefill_chunk, ...)."""
        self.engine = engine
        self.scheduler = scheduler or engine.batch_scheduler(**batch_options)
        self._requests: dict[int, Submitted] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speedc-batch")
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the loop _wake belongs to

    def submit(self, prompt, **params) -> Submitted:
        """Queue a request (Engine.generate's keyword arguments); bad input raises GenerationError here."""
        on_loop_thread = self._bind_event_loop()  # before anything is queued: nothing is left behind
        request = self.engine.request_from(prompt, params)
        sequence = self.scheduler.submit(request, early_flush=self.engine.flush_setting(params.get("early_flush")))
        submitted = Submitted(self.engine, sequence, params.get("stop"))
        self._requests[sequence.id] = submitted
        if on_loop_thread:
            self._start_or_wake()
        else:  # asyncio objects are not thread-safe: wake the loop task on its own thread
            self._event_loop.call_soon_threadsafe(self._start_or_wake)
        return submitted

    @property
    def running(self) -> int:
        """Requests holding a pool row (prefilling or decoding)."""
        return len(self.scheduler.occupied)

    @property
    def waiting(self) -> int:
        """Requests waiting for a free pool row."""
        return len(self.scheduler.waiting)

    def cancel(self, submitted: Submitted) -> None:
        self.scheduler.cancel(submitted.sequence)
        if self._wake is not None and not self._event_loop.is_closed():  # asyncio.Event is not thread-safe:
            self._event_loop.call_soon_threadsafe(self._wake.set)        # set it on its own loop

    def _bind_event_loop(self) -> bool:
        """The event loop the loop task runs on: the caller's on first use, or once the one before has
        closed (its requests, which nothing can await any more, are cancelled). True when called on it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        bound = self._event_loop
        if bound is not None and not bound.is_closed():
            return running is bound
        if running is None:
            raise RuntimeError("EngineLoop.submit needs a running event loop: call it from a coroutine "
                               "(or, from another thread, once the loop has started on its event loop)")
        for submitted in list(self._requests.values()):  # left by an event loop that has closed
            self.scheduler.cancel(submitted.sequence)
        self._requests.clear()
        self._event_loop, self._wake, self._task = running, asyncio.Event(), None
        return True

    def _start_or_wake(self) -> None:
        """On the loop's event loop: the loop task runs (started again if it ended) and looks for work."""
        if self._task is None or self._task.done():
            self._task = self._event_loop.create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.busy:
                self._wake.clear()
                # idle: what the requests freed goes back to the OS (runtimes/heap.py: 3-6 ms after a batch of
                # zoo:small), in a thread of its own so that a request arriving meanwhile does not wait for it
                loop.run_in_executor(None, return_freed_memory)
                await self._wake.wait()
                continue
            try:
                events = await loop.run_in_executor(self._executor, self.scheduler.step)
            except Exception as error:  # e.g. ONNX Runtime failed: the requests in flight end with it; later ones run
                self._end_after_failed_step(error)
                continue
            for sequence, token in events:
                submitted = self._requests.get(sequence.id)
                if submitted is None:
                    continue
                if token is None:
                    del self._requests[sequence.id]
                    submitted._end()
                else:
                    submitted._deliver(token)

    def _end_after_failed_step(self, error: Exception) -> None:
        """A step raised part way, and its events went down with it. The sequences it held end with
        ERROR (their state is unknown); one that had ended before the failure (cancelled at the step's
        start, or finished in it) ends as it did, its undelivered tokens delivered first; waiting
        requests stay queued."""
        self.scheduler.drop_running()
        for key, submitted in list(self._requests.items()):
            sequence = submitted.sequence
            if sequence.state != DONE:
                continue  # still waiting: a later step runs it
            del self._requests[key]
            if sequence.stats.stop_reason:  # it had ended (finished, cancelled, or could not run)
                for token in sequence.out[submitted._delivered:]:
                    submitted._deliver(token)
                submitted._end()
            else:
                submitted._fail(error)

    async def aclose(self) -> None:
        """Stop the loop task (requests in flight are cancelled) and the worker thread."""
        for submitted in list(self._requests.values()):
            self.cancel(submitted)
        if self._task is not None:
            while self.scheduler.busy:
                await asyncio.sleep(0.001)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
