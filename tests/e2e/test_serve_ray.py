"""`speedc serve --ray`: the Ray Serve application is built with the scale-out asked for (checked
without starting Ray, always), and two replicas on a local Ray instance answer the openai client through
Ray's proxy (starting Ray costs about 35 s here, so that test runs with SPEEDC_LONG_TESTS=1)."""

from __future__ import annotations

import os
import time

import httpx
import openai
import pytest

from serve_server import start_server
from speedc import Engine
from speedc.errors import SpeedcError
from speedc.serve.app import ServeSettings
from speedc.serve.ray_deployment import ScaleOut, deployment_options

LONG_TESTS = os.environ.get("SPEEDC_LONG_TESTS") == "1"


def test_deployment_options():
    settings = ServeSettings(artifact="/x", model_name="x", max_batch=4, max_queue=7)
    fixed = deployment_options(settings, ScaleOut(replicas=3, replica_cpus=0.5))
    assert fixed == {"name": "SpeedcReplica", "num_replicas": 3, "max_ongoing_requests": 11,  # 4 run, 7 wait
                     "ray_actor_options": {"num_cpus": 0.5}}
    scaled = deployment_options(settings, ScaleOut(autoscale=(0, 4), max_ongoing_requests=2))
    assert "num_replicas" not in scaled and scaled["max_ongoing_requests"] == 2
    assert scaled["autoscaling_config"] == {"min_replicas": 0, "initial_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 1}
    for bad in (ScaleOut(replicas=0), ScaleOut(autoscale=(3, 2)), ScaleOut(autoscale=(0, 0)),
                ScaleOut(max_ongoing_requests=0), ScaleOut(replica_cpus=-1)):
        with pytest.raises(SpeedcError):
            deployment_options(settings, bad)


def test_build_app_for_ray_serve_run(tiny_artifact):
    """`serve run speedc.serve.ray_deployment:build_app artifact=... num_replicas=...` (Ray's CLI passes
    strings): the application binds one SpeedcReplica deployment with those options (Ray not started)."""
    from speedc.serve.ray_deployment import build_app

    app = build_app({"artifact": str(tiny_artifact), "num_replicas": "3", "max_ongoing_requests": "4",
                     "replica_cpus": "0.25", "max_queue": "5", "mode": "autoregressive", "max_batch": "2",
                     "kv_cache_mb": "1.5"})
    deployment = app._bound_deployment  # Ray keeps the bound deployment here (no public accessor)
    assert (deployment.name, deployment.num_replicas, deployment.max_ongoing_requests) == ("SpeedcReplica", 3, 4)
    assert deployment.ray_actor_options["num_cpus"] == 0.25
    settings = ServeSettings(**deployment.init_args[0])
    assert (settings.artifact, settings.model_name, settings.max_queue, settings.mode) == \
        (str(tiny_artifact), tiny_artifact.name, 5, "autoregressive")
    assert (settings.max_batch, settings.kv_cache_mb) == (2, 1.5)
    autoscaled = build_app({"artifact": str(tiny_artifact), "min_replicas": "1", "max_replicas": "4"})
    config = autoscaled._bound_deployment._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas) == (1, 4)
    with pytest.raises(SpeedcError, match="unknown argument 'replicas'"):
        build_app({"artifact": str(tiny_artifact), "replicas": "2"})


@pytest.mark.skipif(not LONG_TESTS, reason="starts a local Ray instance (~35 s): SPEEDC_LONG_TESTS=1")
def test_two_replicas_on_local_ray(tiny_artifact, tmp_path):
    server = start_server(tiny_artifact, tmp_path, "--model-name", "tiny", "--ray", "--replicas", "2",
                          "--replica-cpus", "0.5", starting=(404, 503))  # Ray's proxy: 404 until the app is up
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        engine = Engine.load(tiny_artifact, threads=1)
        lengths = [1, 2, 4, 8, 16, 32]  # every subset has its own sum: a replica's token count says which it served
        for n in lengths:
            whole = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=n, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert whole.choices[0].text == engine.generate("ROMEO:", max_new_tokens=n, stop_at_eos=False).text
        streamed = client.completions.create(model="tiny", prompt="JULIET:", max_tokens=12, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        expected = engine.generate("JULIET:", max_new_tokens=12, stop_at_eos=False).text
        assert "".join(c.choices[0].text for c in streamed) == expected
        # /metrics answers from one replica or the other: two different counts that add up to all requests.
        seen, deadline = set(), time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            seen.add(server.metrics()["speedc_generation_tokens_total"])
        assert len(seen) == 2 and sum(seen) == sum(lengths) + 12, seen  # an odd total: the two always differ
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()
