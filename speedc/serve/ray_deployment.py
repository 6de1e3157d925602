"""The server as a Ray Serve deployment: one speedc engine per replica, the same OpenAI routes through
Ray's HTTP proxy, replicas fixed or autoscaled.

    client --HTTP--> Ray proxy (every node) --> replica 1: create_app(settings) + Engine
                                           \\-> replica 2: ...         (one Ray actor each)

Two ways in:
  speedc serve OUT --ray --replicas 2                              (starts or joins Ray, blocks)
  serve run speedc.serve.ray_deployment:build_app artifact=/shared/OUT num_replicas=4
                                                                   (Ray's own CLI, on a cluster)
Every node that can host a replica needs speedc (with the serve and ray extras) and the artifact at
the same path.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from speedc.errors import SpeedcError
from speedc.serve.app import ServeSettings

APP_NAME = "speedc"


@dataclass(frozen=True)
class ScaleOut:
    replicas: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) replicas: Ray's autoscaler picks within
    max_ongoing_requests: int | None = None  # per replica; default: its engine's max_batch + queue
    replica_cpus: float = 1.0

    def check(self) -> None:
        if self.replicas < 1:
            raise SpeedcError("--replicas must be at least 1")
        if self.autoscale is not None and not (0 <= self.autoscale[0] <= self.autoscale[1] and self.autoscale[1] >= 1):
            raise SpeedcError("--autoscale MIN MAX needs 0 <= MIN <= MAX and MAX >= 1")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise SpeedcError("--max-ongoing-requests must be at least 1")
        if self.replica_cpus < 0:
            raise SpeedcError("--replica-cpus must be >= 0")


class SpeedcReplica:
    """One replica: its own app and engine, loaded before the replica reports ready."""

    def __init__(self, settings: dict) -> None:
        self.settings = ServeSettings(**settings)

    def __serve_build_asgi_app__(self):
        from speedc.serve.app import create_app

        return create_app(self.settings, load_in_background=False)


def deployment_options(settings: ServeSettings, scale: ScaleOut) -> dict:
    """serve.deployment(...) keyword arguments for SCALE."""
    scale.check()
    ongoing = scale.max_ongoing_requests or settings.max_batch + settings.max_queue  # max_batch run, the rest wait
    options = {"name": "SpeedcReplica", "max_ongoing_requests": ongoing,
               "ray_actor_options": {"num_cpus": scale.replica_cpus}}
    if scale.autoscale is not None:
        low, high = scale.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "initial_replicas": max(low, 1), "max_replicas": high,
                                         "target_ongoing_requests": 1}
    else:
        options["num_replicas"] = scale.replicas
    return options


def build_application(settings: ServeSettings, scale: ScaleOut):
    """The Ray Serve application (not started): SpeedcReplica behind Ray's proxy with SCALE's options."""
    from ray import serve

    ingress = serve.ingress()(SpeedcReplica)  # the app comes from __serve_build_asgi_app__, per replica
    fields = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(settings).items()}
    return serve.deployment(ingress, **deployment_options(settings, scale)).bind(fields)


def build_app(args: dict):
    """For `serve run speedc.serve.ray_deployment:build_app artifact=PATH [key=value ...]`: keys are
    ServeSettings fields (model_name, backend, threads, kv_cache, mode, max_batch, kv_cache_mb, max_queue,
    request_timeout, chat_template) and ScaleOut's (num_replicas, min_replicas + max_replicas, max_ongoing_requests,
    replica_cpus)."""
    args = dict(args)
    if "artifact" not in args:
        raise SpeedcError("build_app needs artifact=PATH")
    artifact = Path(args.pop("artifact")).resolve()
    numbers = {"threads": int, "max_batch": int, "kv_cache_mb": float, "prefix_cache_mb": float, "max_queue": int,
               "request_timeout": float}
    chat = args.pop("chat_template", None)
    settings = ServeSettings(artifact=artifact, model_name=args.pop("model_name", artifact.name),
                             chat_template=Path(chat).resolve() if chat else None,
                             **{k: numbers.get(k, str)(args.pop(k)) for k in ("backend", "device", "threads", "kv_cache", "mode",
                                                                             "max_batch", "kv_cache_mb", "prefix_cache_mb",
                                                                             "max_queue",
                                                                             "request_timeout") if k in args})
    low, high = args.pop("min_replicas", None), args.pop("max_replicas", None)
    ongoing = args.pop("max_ongoing_requests", None)
    scale = ScaleOut(replicas=int(args.pop("num_replicas", 1)),
                     autoscale=(int(low), int(high)) if low is not None and high is not None else None,
                     max_ongoing_requests=int(ongoing) if ongoing is not None else None,
                     replica_cpus=float(args.pop("replica_cpus", 1.0)))
    if args:
        raise SpeedcError(f"build_app: unknown argument {sorted(args)[0]!r}")
    return build_application(settings, scale)


def run_on_ray(settings: ServeSettings, scale: ScaleOut, *, host: str, port: int,
               on_ready: Callable[[], None] = lambda: None) -> None:
    """Start (or join, when RAY_ADDRESS is set) Ray, run the application with Ray's HTTP proxy on
    HOST:PORT, and block until SIGTERM / SIGINT; then shut the application down."""
    import ray
    from ray import serve

    scale.check()
    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_application(settings, scale), name=APP_NAME, route_prefix="/")
        on_ready()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
