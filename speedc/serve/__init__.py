"""`speedc serve`: an OpenAI-compatible HTTP server over a compiled artifact, and its Ray Serve deployment.

    protocol.py        request bodies -> checked parameters (anything unsupported is a 400, never ignored)
    responses.py       response bodies, stream chunks, OpenAI-shaped errors
    chat_template.py   chat messages -> prompt text, rendered like transformers does
    batched_engine.py  the engine adapter (default): continuous batching, bounded queue, streaming, cancel
    engine_adapter.py  the adapters' shared shape, and the one-request-at-a-time adapter (--max-batch 1)
    metrics.py         Prometheus metrics
    app.py             the FastAPI application (routes, streaming, disconnects, timeouts)
    ray_deployment.py  the same application as a Ray Serve deployment (one engine per replica)

Needs the `serve` extra (fastapi, uvicorn, prometheus-client, jinja2); Ray Serve the `ray` extra.
"""
