"""`speedc serve` operations: 429 with Retry-After when every batch slot and queue place is taken (and
requests that give up free their places), the request timeout stops a generation (streamed or whole),
a bundled model's chat template renders its chat prompts and a model without one answers chat with a
400, SIGTERM lets in-flight requests finish before the process exits, the single-sequence engine
(--max-batch 1) still serves, and a batched server opens only the batch scheduler's sessions, and a
request whose KV cache cannot be allocated gets a 503 while the others are served. One `speedc serve`
subprocess for the module (--max-batch 2 --max-queue 1; the SIGTERM test ends it, so it runs last);
other settings run the app in this process."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from conftest import ZOO, assert_one_line_error, build_artifact, run_cli
from serve_server import server_in_this_process, start_server
from speedc import Engine
from speedc.cli.serve import _check_up_front
from speedc.errors import SpeedcError
from speedc.format.artifact import TOKENIZER_CONFIG
from speedc.serve.app import ServeSettings, make_adapter
from speedc.serve.chat_template import load_chat_template

LONG = 480  # tokens: about half a second on zoo:tiny here
BODY = {"model": "tiny", "prompt": "ROMEO:", "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    running = start_server(tiny_artifact, tmp_path_factory.mktemp("serve-ops"), "--model-name", "tiny",
                           "--max-batch", "2", "--max-queue", "1")
    yield running
    running.stop()
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


async def first_event(lines) -> None:
    """Read up to the first event. (Leaving `async for` over aiter_lines() would close the response,
    which the server rightly takes as the client going away.)"""
    while not (await lines.__anext__()).startswith("data: {"):
        pass


async def admitted(http: httpx.AsyncClient, count: int, seconds: float = 5) -> bool:
    """Wait (without blocking the event loop) until COUNT requests run or wait on the engine."""
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        text = (await http.get("/metrics")).text
        gauges = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith(("speedc_requests_running ", "speedc_requests_waiting "))}
        if gauges["speedc_requests_running"] + gauges["speedc_requests_waiting"] >= count:
            return True
        await asyncio.sleep(0.002)
    return False


def test_bad_command_lines_are_one_line_errors(tiny_artifact, tmp_path):
    assert_one_line_error(run_cli("serve", tmp_path / "nothing"), "not an artifact directory")
    nan_timeout = run_cli("serve", tiny_artifact, "--request-timeout", "nan")  # was: every request a 500
    assert nan_timeout.returncode == 2 and "'nan' is not a finite number" in nan_timeout.stderr
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    assert_one_line_error(run_cli("serve", tiny_artifact, "--chat-template", tmp_path / "broken.jinja"),
                          "chat template does not parse")
    # Ray's options without --ray: a local server ignored them (even --replicas 0) and the user believed in replicas
    assert_one_line_error(run_cli("serve", tiny_artifact, "--replicas", "0"), "--replicas goes with --ray")
    # a Latin-1 byte in the name (a lone surrogate here): /v1/models and every response were a 500
    assert_one_line_error(run_cli("serve", tiny_artifact, "--model-name", "m\udce9"),
                          "model name is not Unicode text", "0xe9")
    # the batching options are refused by the same up-front check (in this process: no CLI start-up each)
    refusals = [(dict(kv_cache_mb=0.001), "leaves no room for 8 sequences"), (dict(max_batch=0), "at least 1"),
                (dict(backend="torch"), "--max-batch 1"), (dict(max_batch=1, kv_cache_mb=5.0), "with --max-batch 1"),
                # an fp32 build has no twin that attends on the kernel: its pool stays float32
                (dict(kv_cache="int8"), "--kv-cache int8 needs speedc's attention")]
    for changed, message in refusals:
        options = {"max_batch": 8, "kv_cache_mb": None, "backend": "onnx", "device": "cpu", **changed}
        with pytest.raises(SpeedcError, match=message):
            _check_up_front(tiny_artifact, None, 8000, 4, 60.0, **options)


def test_chat_on_a_bundled_model_renders_its_template(server, tiny_artifact):
    """zoo:tiny's artifact carries a plain-text chat template (models/zoo.py): a chat completion answers
    with text, its prompt the template's rendering (the completions route given the rendered text's ids
    answers the same), and it stops at the model's end of text."""
    messages = [{"role": "user", "content": "Good morrow, sir."}]
    rendered = load_chat_template(tiny_artifact).render(messages)
    assert rendered == "USER.\nGood morrow, sir.\n\nASSISTANT.\n"
    ids = Tokenizer.from_file(str(tiny_artifact / "tokenizer.json")).encode(rendered, add_special_tokens=False).ids
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens == len(ids)
    assert chat.choices[0].finish_reason == plain.choices[0].finish_reason


def test_chat_without_a_template_is_a_400(tmp_path):
    """A model without a chat template answers chat with a 400 that says so: zoo:tiny's checkpoint copied
    out of the zoo, which carries no template of its own (the build writes the bundled models')."""
    bare = build_artifact(shutil.copytree(ZOO / "tiny", tmp_path / "tiny"), tmp_path / "art")
    assert not (bare / TOKENIZER_CONFIG).exists()
    with server_in_this_process(ServeSettings(artifact=bare, model_name="tiny", threads=1)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template") as refused:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["code"] == "no_chat_template"


def test_full_queue_answers_429_with_retry_after(server):
    """A and B run (two batch slots), C waits (the queue holds 1): D is refused. Then all three give up:
    their places and slots come free."""
    long = dict(BODY, max_tokens=LONG)
    before = server.metrics()

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json=dict(long, stream=True)) as a:
                a_lines = a.aiter_lines()
                await first_event(a_lines)  # A holds a slot
                async with http.stream("POST", "/v1/completions", json=dict(long, stream=True)):  # B the other
                    c = asyncio.create_task(http.post("/v1/completions", json=long))  # C waits
                    assert await admitted(http, 3), "A, B and C were not all admitted while A ran"
                    refused = await http.post("/v1/completions", json=long)
                    c.cancel()  # the clients give up: closing the connections cancels B and C, then A
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    cancelled = server.wait_metric("speedc_requests_cancelled_total",
                                   lambda v: v >= before["speedc_requests_cancelled_total"] + 3)
    assert cancelled == before["speedc_requests_cancelled_total"] + 3
    full = 'speedc_request_outcomes_total{outcome="refused",reason="rate_limit_exceeded",status="429"}'
    assert server.metrics()[full] - before.get(full, 0) == 1
    server.wait_metric("speedc_requests_running", lambda v: v == 0)
    assert server.metrics()["speedc_requests_waiting"] == 0
    ok = httpx.post(f"{server.url}/v1/completions", json=dict(BODY, max_tokens=3), timeout=30)
    assert ok.json()["usage"]["completion_tokens"] == 3


def test_request_timeout_stops_streamed_and_whole_generations(tiny_artifact):
    """With a 50 ms timeout a long generation cannot finish: a stream ends with an error event (the
    openai client raises it), a whole response is a 408."""
    settings = ServeSettings(artifact=tiny_artifact, model_name="tiny", threads=1, request_timeout=0.05)
    with server_in_this_process(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        long = dict(model="tiny", prompt="ROMEO:", temperature=0, max_tokens=LONG, extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="request timeout"):
            for _ in client.completions.create(stream=True, **long):
                pass
        with pytest.raises(openai.APIStatusError) as late:
            client.completions.create(**long)
        assert late.value.status_code == 408 and late.value.body["type"] == "timeout_error"
        metrics = httpx.get(f"{url}/metrics").text
        assert "speedc_requests_timed_out_total 2.0" in metrics and "speedc_requests_running 0.0" in metrics
        # each counted by outcome, the stream also as a stream that failed after its 200
        assert 'speedc_request_outcomes_total{outcome="refused",reason="timeout",status="408"} 2.0' in metrics
        assert 'speedc_stream_failures_total{reason="timeout",status="408"} 1.0' in metrics


def test_a_request_whose_cache_cannot_be_allocated_gets_503_and_the_others_are_served(tiny_artifact,
                                                                                     memory_for_256_positions):
    """Before: a request whose KV cache the pool could not grow to hold failed every request running
    beside it with a 500. Now it waits for them, then alone gets a 503 out_of_memory with the engine's
    advice (an error event when streamed); the short requests beside it are served in full."""
    settings = ServeSettings(artifact=tiny_artifact, model_name="tiny", threads=1, max_batch=2)
    expected = Engine.load(tiny_artifact, threads=1).generate("ROMEO:", max_new_tokens=40, stop_at_eos=False).text

    async def scenario(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async def short():
                return await http.post("/v1/completions", json=dict(BODY, max_tokens=40))

            async def long(stream: bool):
                await asyncio.sleep(0.05)
                return await http.post("/v1/completions", json=dict(BODY, max_tokens=300, stream=stream))

            return await asyncio.gather(short(), short(), long(False), long(True))

    with server_in_this_process(settings) as url:
        first, second, whole, streamed = asyncio.run(scenario(url))
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"] == expected
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "out_of_memory"
    assert "cannot grow" in whole.json()["error"]["message"] and "--kv-cache-mb" in whole.json()["error"]["message"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "out_of_memory"


def _events(response: httpx.Response) -> list[dict | str]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
            for line in response.iter_lines() if line.startswith("data: ")]


def test_single_sequence_engine_still_serves(tiny_artifact):
    """--max-batch 1: the single-sequence engine, one request at a time; same answers."""
    settings = ServeSettings(artifact=tiny_artifact, model_name="tiny", threads=1, max_batch=1)
    expected = Engine.load(tiny_artifact, threads=1).generate("ROMEO:", max_new_tokens=12, stop=["\n\n"])
    with server_in_this_process(settings) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        streamed = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12, temperature=0, stop="\n\n",
                                             stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert chunks[-1].usage.completion_tokens == len(expected.ids)
        metrics = httpx.get(f"{url}/metrics").text
        assert "speedc_requests_running 0.0" in metrics and 'speedc_engine_steps_total{sequences="1"}' in metrics
        # the speculation policy's decisions and what it measured here (c(P) per band once both kinds were timed)
        assert 'speedc_policy_decode_steps_total{kind="speed"}' in metrics and "speedc_policy_fallbacks_total" in metrics
        assert "speedc_step_cost_seed" in metrics


def test_batched_server_opens_one_session(tiny_artifact):
    """Serving batched, the batch scheduler's pool runs on the engine's session: its graph is opened once."""
    adapter = make_adapter(ServeSettings(artifact=tiny_artifact, model_name="tiny", threads=1, max_batch=3))
    try:
        assert adapter.max_batch == 3 and adapter.loop.scheduler.backend.session is adapter.engine.backend.session
    finally:
        asyncio.run(adapter.aclose())


def test_sigterm_drains_in_flight_requests(server):
    """SIGTERM while A and B stream: both finish in full, then the process exits."""
    body = dict(BODY, stream=True, stream_options={"include_usage": True})
    with httpx.Client(base_url=server.url, timeout=30) as a_conn, httpx.Client(base_url=server.url, timeout=30) as b_conn:
        with a_conn.stream("POST", "/v1/completions", json=dict(body, max_tokens=40)) as a, \
                b_conn.stream("POST", "/v1/completions", json=dict(body, max_tokens=20)) as b:
            lines = a.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
            b_events = _events(b)
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 40
    assert b_events[-1] == "[DONE]" and b_events[-2]["usage"]["completion_tokens"] == 20
    assert b_events[-3]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises the signal once drained
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")
