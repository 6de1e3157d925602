"""Where the server touches the engine: admission (a bounded queue), streaming, cancellation.

Two adapters of one shape (the server uses nothing else): submit(GenerationRequest) -> a Generation,
an async iterator of Pieces with finish_reason / stats / completion_tokens / cancel() (QueueFull when
max_batch + max_queue requests are already admitted); running / waiting / max_batch / decode_steps for the
metrics; encode, max_context; aclose().

    BatchedEngine (batched_engine.py, the default): continuous batching, up to --max-batch
        generations decode together in each engine step (runtimes/engine_loop.py)
    ThreadedEngine (here, --max-batch 1): one generation at a time on the single-sequence engine

    handler --submit()--> Generation --(its producer task)--> engine worker thread
       ^                      |           waits its turn (FIFO), then runs Engine.stream there at
       +---- async for piece -+           the engine's pace, handing each confirmed piece to the loop

Cancelling really stops the decoding: the engine thread sees the stop flag after the step in progress
and closes the stream there, which frees the engine for the next request (queued behind it on the
same thread).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from speedc.runtimes.detokenize import Piece

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}  # engine -> OpenAI


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


def encode(engine, text: str, special_tokens: bool) -> list[int]:
    """Text -> ids; SPECIAL_TOKENS adds what the tokenizer adds to a plain prompt (a chat template
    writes its own)."""
    if special_tokens or engine.tokenizer is None:
        return engine.encode(text)  # without a tokenizer: the engine's "no tokenizer" error
    from speedc.runtimes.requests import check_text

    check_text(text, "the rendered chat prompt")
    return engine.tokenizer.encode(text, add_special_tokens=False).ids


def prompt_char_limit(engine, context: int) -> int:
    """Characters beyond which a text prompt cannot fit CONTEXT tokens, whatever it says: no token covers
    more characters than the longest vocabulary entry (a byte-level entry has a character per byte, a
    text character at least one byte), and x 4 leaves room for a normalizer that composes characters.
    Servers refuse longer prompts without tokenizing them (5 M characters took 4-6 s of a core)."""
    longest = max((len(token) for token in engine.tokenizer.get_vocab()), default=1)
    return context * max(longest, 1) * 4


class RetryEstimate:
    """Retry-After for a full queue: a place comes free when one of the MAX_BATCH generations running
    finishes, on average every mean generation time / MAX_BATCH (a running mean of engine seconds)."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch, self.mean_seconds = max_batch, 1.0

    def record(self, stats) -> None:
        seconds = stats.prefill_seconds + stats.decode_seconds
        self.mean_seconds = 0.8 * self.mean_seconds + 0.2 * seconds

    def seconds(self) -> int:
        return max(1, math.ceil(self.mean_seconds / self.max_batch))


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()  # ids that end it whatever stop_at_eos says (a chat turn's end)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None  # token id -> bias
    logprobs: int | None = None  # record each new token's log-probability with this many top alternatives
    prompt_logprobs: int | None = None  # the prompt's own, likewise (prefilled a token a run)
    grammar: str | None = None  # llguidance's grammar the output follows
    depth: tuple = ()  # (name, value): loops / exit_at_step / exit_threshold / weighted_exit (runtimes/exit_rule.py)

    def engine_settings(self) -> dict:
        """The keyword arguments Engine.stream and EngineLoop.submit take for it."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, seed=self.seed, repetition_penalty=self.repetition_penalty,
                    stop=list(self.stop) or None, stop_at_eos=self.stop_at_eos, stop_token_ids=list(self.stop_token_ids),
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    logit_bias=self.logit_bias, logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
                    grammar=self.grammar, **dict(self.depth))


@dataclass(frozen=True)
class _Finished:
    stats: object  # the engine's DecodeStats


@dataclass(frozen=True)
class _Failure:
    error: BaseException


class Generation:
    """One admitted request: an async iterator of Pieces. After it ends: finish_reason, stats,
    completion_tokens. cancel() stops it (waiting or running) and frees its pool row."""

    def __init__(self, owner: "ThreadedEngine", stream, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stats = None  # the engine's DecodeStats once finished
        self._owner, self._stream = owner, stream
        self._stop = threading.Event()  # cancel -> the engine thread stops after the step in progress
        self._cancel_requested = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._produce())

    @property
    def logprobs(self) -> list:
        """TokenLogprob of each token handed out so far (when asked)."""
        return self._stream.request.picker.logprobs

    @property
    def prompt_logprobs(self) -> list:
        """TokenLogprob of prompt[1:] (when asked), complete once the first token is out."""
        return self._stream.request.prompt_logprob_values

    def _decode(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: run the stream at the engine's pace, handing each piece to the loop."""
        def hand_over(item) -> None:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)

        stream, counted = self._stream, 0
        try:
            for text in stream:
                if self._stop.is_set():
                    return
                hand_over(Piece(ids=tuple(stream.ids[counted:]), text=text))  # several: a held-back byte sequence
                counted = len(stream.ids)
            if len(stream.ids) > counted:  # tokens whose text a stop string cut off: counted, not shown
                hand_over(Piece(ids=tuple(stream.ids[counted:]), text=""))
            hand_over(_Finished(stream.stats))
        finally:
            stream.close()  # the engine is free for the next request

    async def _produce(self) -> None:
        owner, loop = self._owner, asyncio.get_running_loop()
        waiting, started = True, False
        try:
            async with owner._turn:  # asyncio.Lock wakes waiters first come, first served
                owner.waiting -= 1
                owner.running += 1
                waiting, started = False, True
                await loop.run_in_executor(owner._executor, self._decode, loop)
        except asyncio.CancelledError:
            self._stop.set()  # the engine thread stops after its current step; the next request queues behind it
            raise
        except BaseException as error:  # a backend failure reaches the handler, which answers 500
            self._queue.put_nowait(_Failure(error))
        finally:
            if waiting:
                owner.waiting -= 1
                self._stream.close()  # never started: nothing holds the engine
            if started:
                owner.running -= 1

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> Piece:
        item = await self._queue.get()
        if isinstance(item, Piece):
            self.completion_tokens += len(item.ids)
            return item
        self._queue.put_nowait(item)  # the end stays the end
        if isinstance(item, _Failure):
            raise item.error
        if self.finish_reason is None:
            self.stats = item.stats
            self.finish_reason = FINISH_REASONS.get(item.stats.stop_reason, "stop")
            self._owner._finished(item.stats)
        raise StopAsyncIteration

    def cancel(self) -> bool:
        """Stop generating now (no-op once finished); True when there was something to stop."""
        if self._cancel_requested or self._task.done():
            return False
        self._cancel_requested = True
        self._task.cancel()
        return True


class ThreadedEngine:
    """Engine.stream on one worker thread, one generation at a time, at most MAX_QUEUE waiting."""

    max_batch = 1  # generations that run at once

    def __init__(self, engine, *, max_queue: int, mode: str = "speed") -> None:
        self.engine, self.max_queue, self.mode = engine, max_queue, mode
        self.running = 0
        self.waiting = 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speedc-engine")
        self._turn = asyncio.Lock()
        self._retry = RetryEstimate(self.max_batch)
        self.decode_steps: Counter[int] = Counter()  # sequences per step -> steps (here always 1)

    def describe(self) -> str:
        return f"one request at a time, {self.max_queue} may wait"

    @property
    def prefix_cache(self):
        """The engine's PrefixCache (None: off)."""
        return self.engine.prefix_cache

    # ---- what the server asks of the model ------------------------------------------------------
    @property
    def max_context(self) -> int:
        return self.engine.manifest.dims.max_context

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        return encode(self.engine, text, special_tokens)

    # ---- generations ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> Generation:
        """Admit REQUEST or raise QueueFull; a bad request raises the engine's GenerationError here,
        before it takes a place in the queue. Call from the event loop."""
        if self.running + self.waiting >= self.max_batch + self.max_queue:
            raise QueueFull(self.retry_after())
        stream = self.engine.stream(request.prompt_ids, mode=self.mode, **request.engine_settings())
        self.waiting += 1
        return Generation(self, stream, len(request.prompt_ids))

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free."""
        return self._retry.seconds()

    def host_costs(self) -> dict:
        """Step costs measured on this host (runtimes/step_costs.py StepCosts.report); none before the engine opened."""
        return self.engine.step_costs().report() if self.engine.backend_loaded else {}

    def _finished(self, stats) -> None:
        self._retry.record(stats)
        self.decode_steps[1] += stats.steps

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True)
