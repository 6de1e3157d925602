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
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from speedc.errors import GenerationError, OutOfMemory, SpeedcError
from speedc.runtimes.detokenize import Piece
from speedc.serve.batched_engine import BatchedEngine, BatchedGeneration
from speedc.serve.chat_template import ChatTemplate, TemplateRenderError, load_chat_template
from speedc.serve.engine_adapter import Generation, GenerationRequest, QueueFull, ThreadedEngine, prompt_char_limit
from speedc.serve.metrics import CONTENT_TYPE, Metrics
from speedc.serve.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ApiError, ParsedRequest, parse_request,
                                   read_json)
from speedc.serve.responses import Reply, error_event

log = logging.getLogger("uvicorn.error")  # uvicorn formats and prints it beside its own lines
CLIENT_GONE_STATUS = 499  # nobody reads it: the client closed the connection


@dataclass(frozen=True)
class ServeSettings:
    artifact: Path
    model_name: str
    backend: str = "onnx"
    device: str = "cpu"
    threads: int | None = None
    mode: str = "speed"
    max_batch: int = 8  # requests decoded together (continuous batching); 1: one at a time, single-sequence engine
    kv_cache_mb: float | None = None  # the batching KV-cache pool (None: the model's context per request)
    max_queue: int = 64
    request_timeout: float = 600.0  # seconds from arrival, queueing included
    chat_template: Path | None = None  # overrides the artifact's


def make_adapter(settings: ServeSettings):
    """The engine behind its adapter: batched (the batch scheduler's pool on the engine's one set of
    sessions), or one request at a time when max_batch is 1."""
    from speedc.runtimes.engine import Engine

    batched = settings.max_batch > 1
    engine = Engine.load(settings.artifact, backend=settings.backend, device=settings.device, threads=settings.threads)
    if engine.tokenizer is None:
        raise SpeedcError(f"{settings.artifact}: the server needs an artifact with a tokenizer.json")
    if not batched:
        return ThreadedEngine(engine, max_queue=settings.max_queue, mode=settings.mode)
    return BatchedEngine(engine, max_queue=settings.max_queue, max_batch=settings.max_batch,
                         kv_cache_mb=settings.kv_cache_mb, mode=settings.mode)  # the engine's session


class Service:
    """A loaded model: the engine behind its adapter, and the chat template."""

    def __init__(self, settings: ServeSettings) -> None:
        self.template: ChatTemplate | None = load_chat_template(settings.artifact, settings.chat_template)
        self.adapter = make_adapter(settings)
        self.prompt_char_limit = prompt_char_limit(self.adapter.engine, self.adapter.max_context)
        # a chat completion ends where the template ends an assistant turn (chat_template.end_of_turn_ids)
        self.end_of_turn_ids: tuple[int, ...] = tuple(self.template.end_of_turn_ids(self.adapter.engine.tokenizer)
                                                      if self.template is not None else ())

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
            try:
                text = self.template.render(parsed.messages)
            except TemplateRenderError as refused:
                raise ApiError(400, str(refused), param="messages") from None
            return self.adapter.encode(text, special_tokens=False)
        return self.adapter.encode(parsed.prompt) if isinstance(parsed.prompt, str) else list(parsed.prompt)

    def generation_request(self, parsed: ParsedRequest, ids: list[int]) -> GenerationRequest:
        context, param = self.adapter.max_context, "messages" if parsed.kind == "chat" else "prompt"
        # a request's KV-cache row is the model's context unless --kv-cache-mb made it smaller
        limit = (f"the model's context of {context} tokens" if context == self.adapter.engine.manifest.model["max_context"]
                 else f"a request's share of the server's KV-cache pool ({context} tokens, --kv-cache-mb)")
        if len(ids) >= context:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; that leaves no room within {limit}",
                           param=param, code="context_length_exceeded")
        s = parsed.sampling
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if parsed.kind == "completion" else context - len(ids)
        max_tokens = s.max_tokens if s.max_tokens is not None else min(default, context - len(ids))
        if len(ids) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds {limit}",
                           param="max_tokens", code="context_length_exceeded")
        return GenerationRequest(ids, max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                                 repetition_penalty=s.repetition_penalty, stop=tuple(s.stop),
                                 stop_at_eos=not s.ignore_eos, stop_token_ids=self.stop_token_ids(parsed))


    def stop_token_ids(self, parsed: ParsedRequest) -> tuple[int, ...]:
        """The request's stop_token_ids, and for chat the template's end of turn (ignored as an EOS is)."""
        turn = self.end_of_turn_ids if parsed.kind == "chat" and not parsed.sampling.ignore_eos else ()
        vocab = self.adapter.engine.manifest.model["vocab_size"]
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
        """The generation's pieces; asyncio.TimeoutError once the deadline passes."""
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
                continue  # tokens a stop string cut: counted, nothing to show
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

    async def abandon_later(self) -> None:  # for a BackgroundTask (an async one runs on the event loop)
        self.abandon()


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


def out_of_memory(error: OutOfMemory) -> ApiError:
    """The request's KV cache could not be allocated even with no other request running: the server's
    memory, not the request, is the limit (503, with the engine's advice)."""
    return ApiError(503, str(error), kind="server_error", code="out_of_memory")


async def whole_response(request: Request, reply: Reply, tracker: Tracker) -> Response:
    async def collect() -> str:
        return "".join([piece.text async for piece in tracker.pieces()])

    try:
        text = await until_disconnect(request, asyncio.ensure_future(collect()))
    except asyncio.TimeoutError:
        raise tracker.timed_out() from None
    except OutOfMemory as full:
        raise out_of_memory(full) from None
    except ClientGone:
        return Response(status_code=CLIENT_GONE_STATUS)
    finally:
        tracker.abandon()  # no-op when finished; stops the engine if this handler itself was cancelled
    g = tracker.generation
    return JSONResponse(reply.body(text, g.finish_reason, g.prompt_tokens, g.completion_tokens))


async def stream_events(reply: Reply, tracker: Tracker) -> AsyncIterator[str]:
    try:
        for item in reply.opening_events():
            yield item
        async for piece in tracker.pieces():
            yield reply.text_event(piece.text)
        g = tracker.generation
        for item in reply.closing_events(g.finish_reason, g.prompt_tokens, g.completion_tokens):
            yield item
    except asyncio.TimeoutError:
        yield error_event(tracker.timed_out().body())
    except OutOfMemory as full:
        yield error_event(out_of_memory(full).body())
    except Exception:  # the status line is sent: the error goes in the stream
        log.exception("generation failed")
        yield error_event(ApiError(500, "the generation failed on the server", kind="server_error").body())
    finally:
        tracker.abandon()  # the client went away mid-stream (the task was cancelled): stop the engine


def create_app(settings: ServeSettings, *, load_in_background: bool = True,
               on_load_error: Callable[[str], None] | None = None) -> FastAPI:
    """The application for SETTINGS. It loads the engine at startup: in the background (answering
    /health with 503 meanwhile) or before it accepts requests (Ray replicas: ready means loaded)."""
    metrics = Metrics()

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

    app = FastAPI(title="speedc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        if 400 <= error.status < 500 and error.status != 429:
            metrics.refused.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        return await api_error(request, ApiError(error.status_code, f"{request.method} {request.url.path}: "
                                                                    f"{error.detail}"))

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        log.exception("request failed")
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), status_code=500)

    def service_of(request: Request) -> Service:
        service = request.app.state.service
        if service is None:
            raise ApiError(503, "the model is still loading" if request.app.state.load_error is None
                           else f"the model failed to load: {request.app.state.load_error}", kind="server_error")
        return service

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

    async def respond(request: Request, kind: str) -> Response:
        arrived = time.perf_counter()
        service = service_of(request)
        parsed = parse_request(read_json(await request.body()), kind)
        if parsed.model != settings.model_name:
            raise ApiError(404, f"the model {parsed.model!r} does not exist (this server serves "
                                f"{settings.model_name!r})", param="model", code="model_not_found")
        try:
            ids = await asyncio.to_thread(service.prompt_ids, parsed)
            generation = service.adapter.submit(service.generation_request(parsed, ids))
        except GenerationError as bad:
            raise ApiError(400, str(bad), param="messages" if kind == "chat" else "prompt") from None
        except QueueFull as full:
            metrics.rejected.inc()
            raise ApiError(429, f"the server is full ({service.adapter.slots} running, {service.adapter.max_queue} "
                                f"waiting); retry later",
                           kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(full.retry_after)}) from None
        metrics.prompt_tokens.inc(len(ids))
        tracker = Tracker(metrics, generation, arrived, settings.request_timeout)
        reply = Reply(kind, settings.model_name, include_usage=parsed.include_usage)
        if parsed.stream:
            return StreamingResponse(stream_events(reply, tracker), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(tracker.abandon_later))
        return await whole_response(request, reply, tracker)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await respond(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await respond(request, "chat")

    return app
