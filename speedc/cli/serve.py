"""`speedc serve`: the OpenAI-compatible server (uvicorn), or the same app on Ray Serve (--ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from speedc.cli.options import FiniteFloat, backend_options, compile_option, flag, given_options
from speedc.errors import SpeedcError
from speedc.format import contract
from speedc.runtimes.detokenize import not_unicode
from speedc.runtimes.speculation import MODES


def _check_up_front(artifact: Path, chat_template: Path | None, port: int, max_queue: int, timeout: float,
                    max_batch: int, kv_cache_mb: float | None, backend: str, device: str,
                    prefix_cache_mb: float | None = None, kv_cache: str | None = None) -> None:
    """What can be refused in one line before anything starts (the engine itself loads in the background)."""
    from speedc.format.artifact import read_manifest
    from speedc.serve.chat_template import load_chat_template

    if not 0 <= port <= 65535:
        raise SpeedcError(f"--port {port} is not a TCP port (0..65535)")
    if max_queue < 0:
        raise SpeedcError("--max-queue must be >= 0")
    if timeout <= 0:
        raise SpeedcError("--request-timeout must be > 0 seconds")
    if max_batch < 1:
        raise SpeedcError("--max-batch must be at least 1")
    if prefix_cache_mb is not None and prefix_cache_mb < 0:
        raise SpeedcError("--prefix-cache-mb must be >= 0 (0: no prefix cache)")
    manifest = read_manifest(artifact, verify_hashes=False)  # hashes are checked by the load itself
    load_chat_template(artifact, chat_template)  # a template that does not parse fails here
    if kv_cache not in (None, "float32") and (backend != "onnx" or contract.NATIVE_CACHE not in
                                              manifest.graphs.get(contract.fused(contract.ENGINE), {})):
        raise SpeedcError(f"--kv-cache {kv_cache} needs speedc's attention (--backend onnx on an int8, int4 or 16-bit "
                          f"build), which this run would not have; its KV cache is float32")
    if max_batch == 1:
        if kv_cache_mb is not None:
            raise SpeedcError("--kv-cache-mb sizes the batching pool; with --max-batch 1 there is none")
        return
    from speedc.runtimes.backends.onnx import BATCHING_BACKENDS, row_capacity

    if backend not in BATCHING_BACKENDS or device != "cpu":
        raise SpeedcError(f"continuous batching runs on ONNX Runtime on the CPU (not --backend {backend} --device "
                          f"{device}); serve one request at a time with --max-batch 1")
    if kv_cache_mb is not None and kv_cache_mb <= 0:
        raise SpeedcError("--kv-cache-mb must be > 0")
    row_capacity(manifest, max_batch, kv_cache_mb)  # a pool too small for MAX_BATCH requests fails here


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model id clients send (default: the artifact folder's name).")
@click.option("--chat-template", type=click.Path(path_type=Path), default=None,
              help="A Jinja chat template file (default: the one in the artifact, from tokenizer_config.json).")
@click.option("--mode", type=click.Choice(list(MODES)), default="speed", show_default=True,
              help="speed: SPEED while it pays on this host (step costs measured as it runs, each request's "
                   "acceptance, the batching row policy), plain decoding steps else; speed-always: every step "
                   "speculates; autoregressive: plain decoding only. The same tokens in every mode.")
@click.option("--max-batch", type=int, default=8, show_default=True,
              help="Requests decoded together (continuous batching: they share each engine step). 1: one request "
                   "at a time on the single-sequence engine (any --backend / --device).")
@click.option("--kv-cache-mb", type=FiniteFloat(), default=None,
              help="Most memory for the batching KV-cache pool, shared by the --max-batch requests (default: room "
                   "for the model's whole context each; the pool holds only what the running requests need: their number and "
                   "the longest one). "
                   "A request's prompt + max_tokens must fit its share.")
@click.option("--prefix-cache-mb", type=FiniteFloat(), default=None,
              help="Most memory for the prefix cache: the K/V rows of earlier prompts, reused by a request whose "
                   "prompt begins with the same tokens (a chat's next turn, a shared system prompt), least recently "
                   "used evicted first (default: as much as the KV-cache pool may hold, --kv-cache-mb, at most 1024 "
                   "without it; 0: off).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for a place (beyond --max-batch running); beyond that the server "
                   "answers 429 with Retry-After.")
@click.option("--request-timeout", type=FiniteFloat(), default=600.0, show_default=True,
              help="Seconds a request may take from arrival (queueing included) before it is stopped.")
@click.option("--max-request-bytes", type=int, default=4 << 20, show_default=True,
              help="Largest request body; a larger one is answered 413 before it is read.")
@backend_options
@compile_option
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@click.option("--ray", "use_ray", is_flag=True, help="Serve on Ray Serve (one engine per replica; needs the ray extra).")
@click.option("--replicas", type=int, default=1, show_default=True, help="--ray: fixed number of replicas.")
@click.option("--autoscale", type=(int, int), default=None, metavar="MIN MAX",
              help="--ray: autoscale between MIN and MAX replicas instead of a fixed number.")
@click.option("--max-ongoing-requests", type=int, default=None,
              help="--ray: requests a replica holds at once (default: --max-batch running + --max-queue waiting).")
@click.option("--replica-cpus", type=FiniteFloat(), default=1.0, show_default=True, help="--ray: CPUs reserved per replica.")
def serve(artifact, host, port, model_name, chat_template, mode, max_batch, kv_cache_mb, prefix_cache_mb, max_queue,
          request_timeout, max_request_bytes,
          backend, device, threads, kv_cache, compile_step, log_level, use_ray, replicas, autoscale, max_ongoing_requests, replica_cpus):
    """Serve a compiled ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics)."""
    from speedc.serve.app import ServeSettings

    _check_up_front(artifact, chat_template, port, max_queue, request_timeout, max_batch, kv_cache_mb, backend, device,
                    prefix_cache_mb, kv_cache)
    if max_request_bytes < 1024:
        raise SpeedcError("--max-request-bytes must be at least 1024")
    if compile_step:
        from speedc.runtimes.engine import check_compile

        check_compile(backend)
    ray_only = given_options("replicas", "autoscale", "max_ongoing_requests", "replica_cpus")
    if ray_only and not use_ray:  # they shape the Ray deployment; a local server silently ignored them, bad values too
        raise SpeedcError(f"{flag(ray_only[0])} goes with --ray (scale-out on Ray Serve); this serves one process")
    model_name = model_name or artifact.resolve().name
    problem = not_unicode(model_name)  # every /v1/models answer and response carries it: each was a 500
    if problem:
        raise SpeedcError(f"the model name is not Unicode text ({problem}); give one with --model-name")
    settings = ServeSettings(artifact=artifact.resolve(), model_name=model_name,
                             backend=backend, device=device, threads=threads, kv_cache=kv_cache, compile_step=compile_step,
                             mode=mode,
                             max_batch=max_batch,
                             kv_cache_mb=kv_cache_mb, prefix_cache_mb=prefix_cache_mb, max_queue=max_queue,
                             request_timeout=request_timeout, max_request_bytes=max_request_bytes,
                             chat_template=chat_template.resolve() if chat_template else None)
    if use_ray:
        from speedc.serve.ray_deployment import ScaleOut, run_on_ray

        scale = ScaleOut(replicas=replicas, autoscale=autoscale, max_ongoing_requests=max_ongoing_requests,
                         replica_cpus=replica_cpus)
        run_on_ray(settings, scale, host=host, port=port, on_ready=lambda: click.echo(
            f"serving {settings.model_name!r} on Ray Serve at http://{host}:{port}/v1", err=True))
        return
    _run_uvicorn(settings, host, port, log_level)


def _run_uvicorn(settings, host: str, port: int, log_level: str) -> None:
    """uvicorn's own signal handling drains: on SIGTERM / SIGINT it stops accepting connections, lets
    every request in flight (waiting ones included) finish, then exits."""
    import uvicorn

    from speedc.serve.app import create_app

    failures: list[str] = []
    server: uvicorn.Server | None = None

    def load_failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    app = create_app(settings, on_load_error=load_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                                           lifespan="on"))
    server.run()
    if failures:
        raise SpeedcError(failures[0])
    if not server.started:
        raise SpeedcError(f"cannot listen on {host}:{port} (see the lines above)")
    sys.stdout.flush()
