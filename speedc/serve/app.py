"""The OpenAI-compatible FastAPI application.

    GET  /health               503 while the engine loads, 200 when ready
    GET  /v1/models            the one model served
    POST /v1/completions       prompt (text or token ids)      } streaming (SSE) or whole
    POST /v1/chat/completions  messages through the chat template }
    GET  /metrics              Prometheus

Request path: parse and check the body (protocol.py) -> prompt ids (chat template, tokenizer) ->
admission by the engine adapter (429 + Retry-After when its queue is full) -> pieces of confirmed text
-> one JSON body, or one SSE event per piece. A client that goes away, or the request timeout, cancels
the generation; errors are OpenAI-shaped bodies, never tracebacks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from speedc.errors import GenerationError, OutOfMemory, SpeedcError
from speedc.runtimes.detokenize import Piece
from speedc.runtimes.heap import return_freed_memory
from speedc.serve.batched_engine import BatchedEngine, BatchedGeneration
from speedc.serve.chat_template import ChatTemplate, TemplateRenderError, load_chat_template
from speedc.serve.engine_adapter import Generation, GenerationRequest, QueueFull, ThreadedEngine, prompt_char_limit
from speedc.serve.metrics import CONTENT_TYPE, Metrics
from speedc.serve.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ApiError, ParsedRequest, parse_request,
                                   read_json)
from speedc.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from speedc.serve.tools import call_grammar, parse_call, template_writes_calls
from speedc.serve.responses import Reply, error_event, usage

log = logging.getLogger("uvicorn.error")  # uvicorn formats and prints it beside its own lines
CLIENT_GONE_STATUS = 499  # nobody reads it: the client closed the connection
BODY_SECONDS = 30.0  # a request body must arrive within this (a client trickling bytes holds no handler longer)
GRAMMAR_SECONDS = 10.0  # a grammar must compile (and pass its first two tokens) within this, else 400
GRAMMAR_THREADS = 2  # grammars compile here, never on the engine's thread or the event loop


@dataclass(frozen=True)
class ServeSettings:
    artifact: Path
    model_name: str
    backend: str = "onnx"
    device: str = "cpu"
    threads: int | None = None
    kv_cache: str | None = None  # --kv-cache: the KV cache's values where speedc's kernel attends (None: its default)
    compile_step: bool = False  # --compile: the PyTorch backend's step through torch.compile
    mode: str = "speed"
    max_batch: int = 8  # requests decoded together (continuous batching); 1: one at a time, single-sequence engine
    kv_cache_mb: float | None = None  # the batching KV-cache pool (None: the model's context per request)
    prefix_cache_mb: float | None = None  # None: as much as the KV-cache pool may hold; 0: off
    max_queue: int = 64
    request_timeout: float = 600.0  # seconds from arrival, queueing included
    max_request_bytes: int = 4 << 20  # a larger body is refused (413) before it is read
    chat_template: Path | None = None  # overrides the artifact's


def make_adapter(settings: ServeSettings):
    """The engine behind its adapter: batched (the batch scheduler's pool on the engine's one set of
    sessions), or one request at a time when max_batch is 1."""
    from speedc.runtimes.engine import Engine

    batched = settings.max_batch > 1
    engine = Engine.load(settings.artifact, backend=settings.backend, device=settings.device, threads=settings.threads,
                         compile_step=settings.compile_step, kv_cache=settings.kv_cache)
    if engine.tokenizer is None:
        raise SpeedcError(f"{settings.artifact}: the server needs an artifact with a tokenizer.json")
    if not batched:
        engine.set_prefix_cache(prefix_cache_budget(engine, settings))
        return ThreadedEngine(engine, max_queue=settings.max_queue, mode=settings.mode)
    return BatchedEngine(engine, max_queue=settings.max_queue, max_batch=settings.max_batch,
                         kv_cache_mb=settings.kv_cache_mb, mode=settings.mode,
                         prefix_cache_mb=prefix_cache_budget(engine, settings))  # the engine's session


DEFAULT_PREFIX_CACHE_MB = 1024.0  # without --kv-cache-mb: a full pool at a long context is far more (384 GiB at Ouro-1.4B's)


def prefix_cache_budget(engine, settings: ServeSettings) -> float:
    """MiB for the prefix cache: --prefix-cache-mb, else what the KV-cache pool may hold (--kv-cache-mb, else
    --max-batch rows of the model's whole context, at most DEFAULT_PREFIX_CACHE_MB)."""
    from speedc.runtimes.backends.onnx import pool_bytes_per_position

    if settings.prefix_cache_mb is not None:
        return settings.prefix_cache_mb
    if settings.kv_cache_mb is not None:
        return settings.kv_cache_mb
    context = engine.manifest.dims.max_context
    full = pool_bytes_per_position(engine.manifest) * settings.max_batch * context / (1 << 20)
    return min(full, DEFAULT_PREFIX_CACHE_MB)


class Service:
    """A loaded model: the engine behind its adapter, and the chat template."""

    def __init__(self, settings: ServeSettings) -> None:
        self.template: ChatTemplate | None = load_chat_template(settings.artifact, settings.chat_template)
        self.adapter = make_adapter(settings)
        self.prompt_char_limit = prompt_char_limit(self.adapter.engine, self.adapter.max_context)
        # a chat completion ends where the template ends an assistant turn (chat_template.end_of_turn_ids)
        self.token_texts = TokenTexts(self.adapter.engine.tokenizer)
        self.end_of_turn_ids: tuple[int, ...] = tuple(self.template.end_of_turn_ids(self.adapter.engine.tokenizer)
                                                      if self.template is not None else ())
        self.grammar_threads = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="speedc-grammar")

    async def compile_grammar(self, request: GenerationRequest, field: str) -> GenerationRequest:
        """REQUEST with its grammar compiled and tried (runtimes/constraint.py) in a grammar thread within
        GRAMMAR_SECONDS: the engine steps and the other requests go on meanwhile (llguidance computes without
        the GIL). Each choice's request copies it. A grammar that fails, or takes longer, is a 400."""
        if request.grammar is None:
            return request
        engine = self.adapter.engine
        ends = engine.end_ids(request.stop_at_eos, request.stop_token_ids)  # the ids make_request will end at
        def compile_and_trim():
            try:
                return engine.grammar_constraint(request.grammar, ends)
            finally:
                return_freed_memory()  # a big or failed compile frees 100+ MB that glibc would otherwise keep

        work = asyncio.get_running_loop().run_in_executor(self.grammar_threads, compile_and_trim)
        try:
            constraint = await asyncio.wait_for(asyncio.shield(work), GRAMMAR_SECONDS)
        except asyncio.TimeoutError:  # llguidance's own limits end the compile; its thread is free then
            raise ApiError(400, f"{field}: the grammar did not compile within {GRAMMAR_SECONDS:g} s; give a smaller one",
                           param=field, code="grammar_too_complex") from None
        except GenerationError as bad:
            raise ApiError(400, f"{field}: {bad}", param=field, code="invalid_grammar") from None
        return dataclasses.replace(request, grammar=constraint)

    def prompt_ids(self, parsed: ParsedRequest) -> list[int]:
        """The request's prompt as ids (tokenized, or rendered through the chat template first). Called
        in a worker thread: tokenizing a long prompt must not stall the event loop's other streams."""
        text_chars = (sum(len(str(m.get("content") or "")) for m in parsed.messages) if parsed.kind == "chat"
                      else len(parsed.prompt) if isinstance(parsed.prompt, str) else 0)
        if text_chars > self.prompt_char_limit:
            raise ApiError(400, f"the prompt is {text_chars:,} characters: more tokens than the {self.adapter.max_context} "
                                "a request may hold", param="messages" if parsed.kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if parsed.kind == "chat":
            if self.template is None:
                raise ApiError(400, "this model has no chat template (none in its artifact); use /v1/completions, "
                                    "or start the server with --chat-template FILE", param="messages",
                               code="no_chat_template")
            if parsed.tools and not template_writes_calls(self.template.source):
                raise ApiError(400, "this model's chat template does not write tool calls as <tool_call> JSON </tool_call> "
                                    "(the format this server knows)", param="tools", code="unsupported_parameter")
            try:
                text = self.template.render(parsed.messages, tools=parsed.tools)
            except TemplateRenderError as refused:
                raise ApiError(400, str(refused), param="messages") from None
            return self.adapter.encode(text, special_tokens=False)
        return self.adapter.encode(parsed.prompt) if isinstance(parsed.prompt, str) else list(parsed.prompt)

    def generation_request(self, parsed: ParsedRequest, ids: list[int]) -> GenerationRequest:
        context, param = self.adapter.max_context, "messages" if parsed.kind == "chat" else "prompt"
        # a request's KV-cache row is the model's context unless --kv-cache-mb made it smaller
        limit = (f"the model's context of {context} tokens" if context == self.adapter.engine.manifest.dims.max_context
                 else f"a request's share of the server's KV-cache pool ({context} tokens, --kv-cache-mb)")
        if len(ids) >= context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; that leaves no room within {limit}",
                           param=param, code="context_length_exceeded")
        s = parsed.sampling
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if parsed.kind == "completion" else context - len(ids)
        max_tokens = s.max_tokens if s.max_tokens is not None else min(default, context - len(ids))
        max_tokens = max(max_tokens, 1)  # 0 (echo: the prompt scored alone) runs one token nobody sees
        if len(ids) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {limit}",
                           param="max_tokens", code="context_length_exceeded")
        vocab = self.adapter.engine.manifest.dims.vocab_size
        bad = next((i for i in s.logit_bias or {} if i >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"logit_bias: {bad} is outside the vocabulary (0..{vocab - 1})", param="logit_bias")
        stop_ids = self.stop_token_ids(parsed)
        if parsed.tools:
            s = dataclasses.replace(s, grammar=call_grammar(parsed.tools, parsed.tool_choice), grammar_field="tools")
        if s.grammar is not None and not stop_ids and (s.ignore_eos or not self.adapter.engine.eos_token_ids):
            raise ApiError(400, f"{s.grammar_field} needs an end: not with ignore_eos (or give stop_token_ids)",
                           param=s.grammar_field)
        # best_of ranks its generations by their tokens' log-probabilities: recorded even where not shown
        logprobs = s.logprobs if s.logprobs is not None or s.best_of == s.n else 0
        return GenerationRequest(ids, max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                                 repetition_penalty=s.repetition_penalty, stop=tuple(s.stop),
                                 stop_at_eos=not s.ignore_eos, stop_token_ids=stop_ids, grammar=s.grammar,
                                 presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                                 logit_bias=s.logit_bias, logprobs=logprobs,
                                 prompt_logprobs=s.logprobs if s.echo else None, depth=s.depth)

    def choice_requests(self, parsed: ParsedRequest, ids: list[int]) -> list[GenerationRequest]:
        """One generation per choice (best_of of them, n shown). With a seed, choice i draws from seed + i,
        so each choice is the generation a request with that seed alone gives."""
        request = self.generation_request(parsed, ids)
        count, seed = parsed.sampling.best_of, parsed.sampling.seed
        return [request if i == 0 or seed is None else dataclasses.replace(request, seed=seed + i) for i in range(count)]

    def stop_token_ids(self, parsed: ParsedRequest) -> tuple[int, ...]:
        """The request's stop_token_ids, and for chat the template's end of turn (ignored as an EOS is)."""
        turn = self.end_of_turn_ids if parsed.kind == "chat" and not parsed.sampling.ignore_eos else ()
        vocab = self.adapter.engine.manifest.dims.vocab_size
        bad = next((i for i in parsed.sampling.stop_token_ids if i >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})", param="stop_token_ids")
        return tuple(dict.fromkeys(parsed.sampling.stop_token_ids + turn))


class ClientGone(Exception):
    pass


class Tracker:
    """One admitted request's generation, its deadline, and the metrics of how it went."""

    def __init__(self, metrics: Metrics, generation: Generation | BatchedGeneration, arrived: float,
                 timeout: float) -> None:
        self.metrics, self.generation = metrics, generation
        self.arrived, self.deadline = arrived, arrived + timeout
        self.timeout = timeout
        self._last: float | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        """The generation's pieces (those without text too); asyncio.TimeoutError once the deadline passes."""
        while True:
            remaining = self.deadline - time.perf_counter()
            if remaining <= 0:
                raise asyncio.TimeoutError
            try:
                piece = await asyncio.wait_for(self.generation.__anext__(), remaining)
            except StopAsyncIteration:
                break
            self.metrics.generation_tokens.inc(len(piece.ids))
            if not piece.text:
                yield piece  # tokens whose text is held back (or a stop string cut): their log-probabilities
                continue
            now = time.perf_counter()
            if self._last is None:
                self.metrics.ttft.observe(now - self.arrived)
            else:
                self.metrics.itl.observe(now - self._last)
            self._last = now
            yield piece
        self.metrics.record_finished(self.generation.finish_reason, self.generation.stats)

    def timed_out(self) -> ApiError:
        self.generation.cancel()
        self.metrics.timed_out.inc()
        return ApiError(408, f"the request did not finish within the server's request timeout ({self.timeout:g} s)",
                        kind="timeout_error", code="timeout")

    def abandon(self) -> None:
        """The client is gone (or the response ended early): stop generating for it."""
        if self.generation.cancel():
            self.metrics.cancelled.inc()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: asyncio.Future):
    """WORK's result, or ClientGone when the client closes the connection first (work is cancelled)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work not in done:
        raise ClientGone
    return work.result()


def parse_body(raw: bytes, kind: str) -> ParsedRequest:
    try:
        return parse_request(read_json(raw), kind)
    finally:
        if len(raw) > BIG_BODY:
            return_freed_memory()


BIG_BODY = 1 << 20  # bytes: the JSON of a body this large takes many times its size while it is parsed


def generation_failed(error: Exception, param: str) -> ApiError:
    """What a client is told when its own generation ended with ERROR. Its KV cache could not be allocated even
    alone: 503, the server's memory is the limit. Its own input failed in the engine (a grammar that fails part
    way, a setting the checks let through): 400 about PARAM. Else the step it ran in failed: 500, the server's
    log has why (never the client)."""
    if isinstance(error, OutOfMemory):
        return ApiError(503, str(error), kind="server_error", code="out_of_memory")
    if isinstance(error, GenerationError):
        return ApiError(400, f"{param}: {str(error).splitlines()[0] if str(error) else 'the generation failed'}",
                        param=param, code="generation_failed")
    log.error("generation failed: %s: %s", type(error).__name__, error)
    return ApiError(500, "the generation failed on the server", kind="server_error", code="server_error")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's JSON body, refused before it is read where it cannot be one: not application/json (415:
    a web page's cross-origin form or text/plain post never reaches the engine), over LIMIT bytes (413, by its
    Content-Length or as it arrives), not in within BODY_SECONDS (408). ClientGone when the client aborts."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the request body must be application/json, not {kind or 'unstated'}",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the request body is over this server's limit of {limit:,} bytes (--max-request-bytes)",
                         code="request_too_large")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_SECONDS:g} s", code="body_timeout",
                       headers={"Connection": "close"}) from None  # the rest of a slow body is not waited for
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


@dataclass
class Choice:
    """One choice of a response: its tracked generation, and what it shows beyond the text (the echoed
    prompt, log-probabilities)."""
    index: int
    tracker: Tracker
    show_tokens: bool = True  # False: max_tokens 0 with echo, the one token run is not shown
    _given: int = 0  # tokens whose log-probabilities went out

    @property
    def generation(self):
        return self.tracker.generation

    def logprob_entries(self, count: int) -> list[tuple[int, object]]:
        """(token, TokenLogprob) of the next COUNT tokens handed out."""
        entries = self.generation.logprobs[self._given:self._given + count]
        self._given += count
        return [(entry.token, entry) for entry in entries]

    @property
    def completion_tokens(self) -> int:
        return self.generation.completion_tokens if self.show_tokens else 0

    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.generation.logprobs[:self.generation.completion_tokens])


@dataclass
class Shown:
    """How a response renders what the engine produced (one per request, shared by its choices)."""
    reply: Reply
    texts: TokenTexts | None
    prompt_ids: list[int]
    prompt_text: str  # echo: the prompt as sent (or its ids' text)
    echo: bool
    logprobs: bool
    tools: bool  # chat with tools offered: an output that is a call becomes tool_calls
    metrics: Metrics  # where the response's outcome is counted
    param: str  # the request field its generation's own errors (a grammar's) are about

    def logprobs_of(self, entries: list, offset: int = 0) -> dict | None:
        if not self.logprobs:
            return None
        if self.reply.kind == "chat":
            return chat_logprobs(self.texts, entries)
        return completion_logprobs(self.texts, entries, offset)

    def prompt_entries(self, choice: Choice) -> list:
        return [(self.prompt_ids[0], None)] + [(e.token, e) for e in choice.generation.prompt_logprobs]

    def usage(self, choices: list[Choice]) -> dict:
        stats = choices[0].generation.stats
        return usage(len(self.prompt_ids), sum(c.completion_tokens for c in choices),
                     stats.cached_tokens if stats is not None else 0)


async def whole_response(request: Request, shown: Shown, choices: list[Choice], shown_count: int) -> Response:
    async def collect(choice: Choice) -> str:
        return "".join([piece.text async for piece in choice.tracker.pieces()])

    async def collect_all() -> list[str]:  # a task: cancelled as a whole when the client goes away
        return await asyncio.gather(*map(collect, choices))

    try:
        texts = await until_disconnect(request, asyncio.ensure_future(collect_all()))
    except asyncio.TimeoutError:
        raise choices[0].tracker.timed_out() from None
    except ClientGone:
        shown.metrics.record_outcome(CLIENT_GONE_STATUS)
        return Response(status_code=CLIENT_GONE_STATUS)
    except Exception as failed:
        raise generation_failed(failed, shown.param) from None
    finally:
        for choice in choices:
            choice.tracker.abandon()  # no-op when finished; stops the engine if this handler itself was cancelled
    ranked = list(zip(choices, texts))
    if shown_count < len(choices):  # best_of: the highest cumulative log-probability first
        ranked = sorted(ranked, key=lambda pair: -pair[0].cumulative_logprob())[:shown_count]
    bodies = []
    for index, (choice, text) in enumerate(ranked):
        g = choice.generation
        entries = choice.logprob_entries(g.completion_tokens) if choice.show_tokens else []
        text = text if choice.show_tokens else ""
        if shown.echo:
            entries = shown.prompt_entries(choice) + entries
            text = shown.prompt_text + text
        calls = parse_call(text) if shown.tools else None
        body = shown.reply.choice(index, None if calls else text, "tool_calls" if calls else g.finish_reason,
                                  shown.logprobs_of(entries))
        if calls:
            body["message"]["tool_calls"] = calls
        bodies.append(body)
    shown.metrics.record_outcome(200)
    return JSONResponse(shown.reply.body(bodies, shown.usage(choices)))


async def stream_events(shown: Shown, choices: list[Choice]) -> AsyncIterator[str]:
    """The choices' chunks as their tokens come, interleaved; each choice's finish chunk when it ends."""
    reply, queue = shown.reply, asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for piece in choice.tracker.pieces():
                queue.put_nowait((choice, piece))
            queue.put_nowait((choice, None))
        except Exception as error:  # handed to the response's loop, which answers with it
            queue.put_nowait((choice, error))

    pumps = [asyncio.ensure_future(pump(choice)) for choice in choices]
    offsets = {choice.index: 0 for choice in choices}  # completions' text_offset so far
    echoed: set[int] = set()
    ended = False  # with its last event or an error event; else the client went away mid-stream
    try:
        for item in reply.opening_events(len(choices)):
            yield item
        running = len(choices)
        while running:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                error = choice.tracker.timed_out() if isinstance(item, asyncio.TimeoutError) else generation_failed(item, shown.param)
                shown.metrics.record_outcome(error.status, error.code or error.kind, streamed=True)
                ended = True
                yield error_event(error.body())
                return
            if shown.echo and choice.index not in echoed:  # the prompt first (its log-probabilities are known now)
                echoed.add(choice.index)
                yield reply.text_event(shown.prompt_text, choice.index,
                                       shown.logprobs_of(shown.prompt_entries(choice), 0))
                offsets[choice.index] = len(shown.prompt_text)
            if item is None:
                running -= 1
                pending = choice.logprob_entries(choice.generation.completion_tokens - choice._given) if choice.show_tokens else []
                yield reply.finish_event(choice.generation.finish_reason, choice.index,
                                         shown.logprobs_of(pending, offsets[choice.index]) if pending else None)
                continue
            if not choice.show_tokens or not item.text:
                continue  # its tokens' log-probabilities go out with the next text
            entries = choice.logprob_entries(choice.generation.completion_tokens - choice._given)
            yield reply.text_event(item.text, choice.index, shown.logprobs_of(entries, offsets[choice.index]))
            offsets[choice.index] += len(item.text)
        ended = True
        shown.metrics.record_outcome(200)
        for item in reply.closing_events(shown.usage(choices)):
            yield item
    finally:
        if not ended:
            shown.metrics.record_outcome(CLIENT_GONE_STATUS)
        for task in pumps:
            task.cancel()
        for choice in choices:
            choice.tracker.abandon()  # the client went away mid-stream (the task was cancelled): stop the engine


def create_app(settings: ServeSettings, *, load_in_background: bool = True,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The application for SETTINGS. It loads the engine at startup: in the background (answering
    /health with 503 meanwhile) or before it accepts requests (Ray replicas: ready means loaded)."""
    metrics = Metrics()
    app = FastAPI(title="speedc", lifespan=service_lifespan(settings, metrics, load_in_background, on_load_error),
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    add_error_handlers(app, metrics)

    @app.get("/health")
    async def health(request: Request):
        if request.app.state.service is not None:
            return {"status": "ok"}
        status = "loading" if request.app.state.load_error is None else "failed"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        card = {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "speedc"}
        if request.app.state.service is not None:
            card["max_model_len"] = request.app.state.service.adapter.max_context
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, "completion", settings, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, "chat", settings, metrics)

    return app


def service_lifespan(settings: ServeSettings, metrics: Metrics, load_in_background: bool,
                     on_load_error: Callable[[str], None] | None):
    """The app's lifespan: the Service (engine, adapter, grammar threads) loaded at startup, closed at shutdown;
    app.state.service stays None while it loads, app.state.load_error says why it did not."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.service, app.state.load_error = None, None

        async def load() -> None:
            try:
                service = await asyncio.to_thread(Service, settings)
            except Exception as failed:  # SpeedcError says it in a line; anything else gets its type too
                message = str(failed) if isinstance(failed, SpeedcError) else f"{type(failed).__name__}: {failed}"
                app.state.load_error = message
                log.error("cannot load %s: %s", settings.artifact, message)
                if on_load_error is not None:
                    on_load_error(message)
                if not load_in_background:
                    raise
                return
            metrics.watch(service.adapter)
            app.state.service = service
            log.info("serving %s as model %r (%s)", settings.artifact, settings.model_name, service.adapter.describe())

        loading = asyncio.create_task(load()) if load_in_background else None
        if loading is None:
            await load()
        yield
        if loading is not None and not loading.done():
            loading.cancel()
        if app.state.service is not None:
            await app.state.service.adapter.aclose()
            app.state.service.grammar_threads.shutdown(wait=False, cancel_futures=True)

    return lifespan


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error as an OpenAI error body, counted by outcome; an unexpected one logged with its trace."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        metrics.record_outcome(error.status, error.code or error.kind)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return await api_error(request, ApiError(error.status_code, f"{request.method} {request.url.path}: "
                                                                    f"{error.detail}"))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        log.exception("request failed")
        metrics.record_outcome(500, "server_error")
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), status_code=500)


def service_of(request: Request) -> Service:
    service = request.app.state.service
    if service is None:
        raise ApiError(503, "the model is still loading" if request.app.state.load_error is None
                       else f"the model failed to load: {request.app.state.load_error}", kind="server_error")
    return service


async def respond(request: Request, kind: str, settings: ServeSettings, metrics: Metrics) -> Response:
    """One completion (KIND "completion") or chat completion ("chat") request, whole or streamed."""
    arrived = time.perf_counter()
    service = service_of(request)
    try:
        raw = await read_body(request, settings.max_request_bytes)
    except ClientGone:  # an upload aborted part way: nothing to answer, nothing to trace
        log.info("%s %s: the client closed the connection before its request body arrived",
                 request.method, request.url.path)
        metrics.record_outcome(CLIENT_GONE_STATUS)
        return Response(status_code=CLIENT_GONE_STATUS)
    # parsing a body of megabytes, or a schema into a grammar, takes a worker thread, not the event loop
    parsed = await asyncio.to_thread(parse_body, raw, kind)
    if parsed.model != settings.model_name:
        raise ApiError(404, f"the model {parsed.model!r} does not exist (this server serves "
                            f"{settings.model_name!r})", param="model", code="model_not_found")
    s = parsed.sampling
    # the field a failure of the request's own generation is about (its grammar's, else its prompt's)
    param = "tools" if parsed.tools else s.grammar_field or ("messages" if kind == "chat" else "prompt")
    ids, generations = await submit_choices(service, parsed, kind, param)
    metrics.prompt_tokens.inc(len(ids))
    scoring_only = s.echo and s.max_tokens == 0
    choices = [Choice(i, Tracker(metrics, generation, arrived, settings.request_timeout), show_tokens=not scoring_only)
               for i, generation in enumerate(generations)]
    reply = Reply(kind, settings.model_name, include_usage=parsed.include_usage)
    prompt_text = ""
    if s.echo:
        prompt_text = parsed.prompt if isinstance(parsed.prompt, str) else service.adapter.engine.decode_text(ids)
    shown = Shown(reply, service.token_texts, ids, prompt_text, s.echo, s.logprobs is not None, bool(parsed.tools),
                  metrics, param)
    if parsed.stream:
        async def abandon_all() -> None:
            for choice in choices:
                choice.tracker.abandon()

        return StreamingResponse(stream_events(shown, choices), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"}, background=BackgroundTask(abandon_all))
    return await whole_response(request, shown, choices, s.n)


async def submit_choices(service: Service, parsed, kind: str, param: str) -> tuple[list[int], list]:
    """(The prompt's ids, one generation per choice) submitted to the engine: the prompt encoded and the grammar
    compiled off the event loop, all of a request's choices admitted or none (400 on its own bad input,
    429 where the queue cannot take them)."""
    generations = []
    try:
        ids = await asyncio.to_thread(service.prompt_ids, parsed)
        requests = service.choice_requests(parsed, ids)
        if requests[0].grammar is not None:
            compiled = await service.compile_grammar(requests[0], param)
            requests = [dataclasses.replace(one, grammar=compiled.grammar) for one in requests]
        adapter = service.adapter
        if adapter.running + adapter.waiting + len(requests) > adapter.max_batch + adapter.max_queue:
            raise QueueFull(adapter.retry_after())
        for one in requests:
            generations.append(adapter.submit(one))
    except GenerationError as bad:
        for generation in generations:
            generation.cancel()
        raise ApiError(400, str(bad), param="messages" if kind == "chat" else "prompt") from None
    except QueueFull as full:
        for generation in generations:
            generation.cancel()
        raise ApiError(429, f"the server is full ({service.adapter.max_batch} running, {service.adapter.max_queue} "
                            f"waiting); retry later",
                       kind="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(full.retry_after)}) from None
    return ids, generations
