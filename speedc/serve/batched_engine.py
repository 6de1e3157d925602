"""The server's default engine adapter: continuous batching over runtimes/engine_loop.py.

    handler --submit()--> BatchedGeneration --wraps--> EngineLoop.Submitted
       ^                        |                          |  one scheduler step at a time on the loop's
       +------ async for piece -+   <-- confirmed tokens --+  worker thread: every admitted request
                                                              (up to max_batch) decodes in that step

Same shape as ThreadedEngine (engine_adapter.py), so nothing else in the server knows which runs. A
request holds one of MAX_BATCH pool rows of the KV-cache pool from its prefill to its end; up
to MAX_QUEUE more wait for a pool row (FIFO) and beyond that submit() raises QueueFull. Cancelling marks
the sequence; the scheduler frees its pool row at the next step boundary. Each sequence's output equals
what it produces alone (the scheduler's lossless promise), so the server's answers equal
`speedc generate` whatever else runs beside them.
"""

from __future__ import annotations

from speedc.runtimes.backends.onnx import pool_bytes_per_position
from speedc.runtimes.speculation import MODES
from speedc.runtimes.detokenize import Piece
from speedc.runtimes.engine_loop import EngineLoop, Submitted
from speedc.serve.engine_adapter import FINISH_REASONS, GenerationRequest, QueueFull, RetryEstimate, encode



class BatchedGeneration:
    """One admitted request: an async iterator of Pieces (one per confirmed token, its settled text).
    After it ends: finish_reason, stats, completion_tokens. cancel() stops it, waiting or running."""

    def __init__(self, owner: "BatchedEngine", submitted: Submitted, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stats = None  # the sequence's DecodeStats once finished
        self._owner, self._submitted = owner, submitted
        self._cancel_requested = False

    @property
    def logprobs(self) -> list:
        """TokenLogprob of each token handed out so far (when asked)."""
        return self._submitted.sequence.request.picker.logprobs

    @property
    def prompt_logprobs(self) -> list:
        """TokenLogprob of prompt[1:] (when asked), complete once the first token is out."""
        return self._submitted.sequence.request.prompt_logprob_values

    def __aiter__(self) -> "BatchedGeneration":
        return self

    async def __anext__(self) -> Piece:
        try:
            piece = await self._submitted.__anext__()
        except StopAsyncIteration:
            if self.finish_reason is None:
                self.stats = self._submitted.result.stats
                self.finish_reason = FINISH_REASONS.get(self.stats.stop_reason, "stop")
                self._owner._retry.record(self.stats)
            raise
        self.completion_tokens += len(piece.ids)  # none: text held back until the end (a cut stop string)
        return piece

    def cancel(self) -> bool:
        """Stop generating now (no-op once finished); True when there was something to stop."""
        if self._cancel_requested or self._submitted.result is not None or self._submitted.error is not None:
            return False
        self._cancel_requested = True
        self._owner.loop.cancel(self._submitted)
        return True


class BatchedEngine:
    """An EngineLoop over ENGINE's batch scheduler: MAX_BATCH sequences decode together, MAX_QUEUE wait."""

    def __init__(self, engine, *, max_queue: int, max_batch: int = 8, kv_cache_mb: float | None = None,
                 mode: str = "speed", threads: int | None = None, fused: bool | None = None,
                 prefix_cache_mb: float | None = None) -> None:
        self.engine, self.max_queue, self.max_batch = engine, max_queue, max_batch
        rules = MODES[mode]
        self.loop = EngineLoop(engine, max_batch=max_batch, kv_cache_mb=kv_cache_mb, row_budget=rules.batch_row_budget,
                               per_sequence=rules.per_sequence, threads=threads, fused=fused, prefix_cache_mb=prefix_cache_mb)
        self._retry = RetryEstimate(max_batch)

    def describe(self) -> str:
        backend = self.loop.scheduler.backend
        value_bytes = getattr(backend, "cache_value_bytes", 4)
        mib = pool_bytes_per_position(self.engine.manifest, value_bytes) * self.max_batch * (backend.pool.capacity + 1) / (1 << 20)
        return (f"continuous batching: up to {self.max_batch} requests at once, {self.max_queue} may wait; KV-cache pool "
                f"up to {mib:.0f} MiB ({getattr(backend, 'kv_cache', 'float32')}; it grows with the requests in it), "
                f"{backend.pool.capacity} positions per request")

    # ---- what the server asks of the model and the metrics ---------------------------------------
    @property
    def max_context(self) -> int:
        """Prompt + completion tokens one request may hold: its KV-cache row (at most the model's context)."""
        return self.loop.scheduler.backend.pool.capacity

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        return encode(self.engine, text, special_tokens)

    @property
    def prefix_cache(self):
        """The scheduler's PrefixCache (None: off)."""
        return self.loop.scheduler.prefix_cache

    @property
    def running(self) -> int:
        return self.loop.running

    @property
    def waiting(self) -> int:
        return self.loop.waiting

    def host_costs(self) -> dict:
        """Step costs measured on this host (runtimes/step_costs.py StepCosts.report)."""
        return self.loop.scheduler.costs.report()

    @property
    def decode_steps(self):
        """Sequences decoded together -> engine steps so far."""
        return self.loop.scheduler.decode_steps

    # ---- generations ------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> BatchedGeneration:
        """Admit REQUEST or raise QueueFull; a bad request raises GenerationError before it is admitted.
        Call from the event loop."""
        if self.running + self.waiting >= self.max_batch + self.max_queue:
            raise QueueFull(self._retry.seconds())
        submitted = self.loop.submit(request.prompt_ids, **request.engine_settings())
        return BatchedGeneration(self, submitted, len(request.prompt_ids))

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free."""
        return self._retry.seconds()

    async def aclose(self) -> None:
        await self.loop.aclose()
