"""`speedc serve` operations, on a server with a short queue and a short request timeout: 429 with
Retry-After when the queue is full, the timeout stops a generation (streamed or whole), a model without
a chat template answers chat with a 400, and SIGTERM lets in-flight requests (running and waiting)
finish before the process exits. One server for the module; the SIGTERM test ends it, so it runs last."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest

from serve_server import start_server

TIMEOUT = 0.5  # --request-timeout: far longer than a short request, shorter than two long ones
LONG = 480  # tokens: a few tenths of a second on zoo:tiny


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    running = start_server(tiny_artifact, tmp_path_factory.mktemp("serve-ops"), "--model-name", "tiny",
                           "--max-queue", "2", "--request-timeout", str(TIMEOUT))
    yield running
    running.stop()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_chat_without_a_template_is_a_400(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no chat template") as refused:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["code"] == "no_chat_template"


def test_full_queue_answers_429_and_the_timeout_stops_generations(server):
    """A runs, B and C wait (the queue holds 2), D is refused. B and C cannot finish in time: B's
    stream ends with a timeout error event, C gets a 408."""
    long = dict(model="tiny", prompt="ROMEO:", max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True})
    before = server.metrics()

    async def scenario():
        async with async_client(server) as client:
            a = await client.completions.create(stream=True, **long)
            await a.__anext__()  # A holds the engine
            b = await client.completions.create(stream=True, **long)  # admitted: the status line is back
            c = asyncio.create_task(client.completions.create(**long))
            while server.metrics()["speedc_requests_waiting"] < 2:
                await asyncio.sleep(0.005)
            with pytest.raises(openai.RateLimitError) as full:
                await client.completions.create(**long)
            with pytest.raises(openai.APIError, match="request timeout"):
                async for _ in b:
                    pass
            with pytest.raises(openai.APIStatusError) as late:
                await c
            await a.close()
            return full.value, late.value

    full, late = asyncio.run(scenario())
    assert full.status_code == 429 and int(full.response.headers["retry-after"]) >= 1
    assert full.body["code"] == "rate_limit_exceeded"
    assert late.status_code == 408 and late.body["type"] == "timeout_error"
    after = server.metrics()
    assert after["speedc_requests_rejected_total"] - before["speedc_requests_rejected_total"] == 1
    assert after["speedc_requests_timed_out_total"] - before["speedc_requests_timed_out_total"] >= 2  # B, C (A maybe)
    server.wait_metric("speedc_requests_running", lambda v: v == 0)
    assert server.metrics()["speedc_requests_waiting"] == 0


def _events(response: httpx.Response) -> list[dict | str]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in response.iter_lines() if line.startswith("data: ")]


def test_sigterm_drains_in_flight_requests(server):
    """SIGTERM while A streams and B waits: both finish in full, then the process exits."""
    body = {"model": "tiny", "prompt": "ROMEO:", "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=server.url, timeout=30) as a_conn, httpx.Client(base_url=server.url, timeout=30) as b_conn:
        with a_conn.stream("POST", "/v1/completions", json=dict(body, max_tokens=60)) as a, \
                b_conn.stream("POST", "/v1/completions", json=dict(body, max_tokens=30)) as b:
            lines = a.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
            b_events = _events(b)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 60
    assert b_events[-1] == "[DONE]" and b_events[-2]["usage"]["completion_tokens"] == 30
    assert b_events[-3]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal once drained
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
