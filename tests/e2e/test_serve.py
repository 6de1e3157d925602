"""`speedc serve` on loopback, driven by the real openai client (sync and async): its output equals
`speedc generate` for the same prompt and settings, streamed or whole; usage numbers; stop strings;
chat through a template; 8 concurrent streams; a client that goes away cancels its generation; bad
requests get OpenAI-shaped errors and the server keeps serving. One server for the whole module,
batching (the default --max-batch 8): concurrent requests share engine steps."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest

from conftest import run_cli
from serve_server import start_server
from speedc import Engine

# trim_blocks drops the newline after each tag, so this renders "<|role|>\ncontent\n" per message.
CHAT_TEMPLATE = """{% for message in messages %}
<|{{ message.role }}|>
{{ message.content }}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}
"""
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234)  # + top_k through the extra body


@pytest.fixture(scope="module")
def server(tiny_artifact, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    (folder / "chat.jinja").write_text(CHAT_TEMPLATE)
    running = start_server(tiny_artifact, folder, "--model-name", "tiny", "--chat-template", str(folder / "chat.jinja"),
                           "--max-queue", "16")
    yield running
    assert running.stop() == -signal.SIGTERM, running.log.read_text()  # drained, then uvicorn re-raises the signal
    assert "Traceback" not in running.log.read_text(), running.log.read_text()


@pytest.fixture(scope="module")
def engine(tiny_artifact):
    return Engine.load(tiny_artifact, threads=1)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_completion_equals_speedc_generate(server, client, tiny_artifact, settings):
    cli = ["--temperature", str(settings["temperature"])]
    if "seed" in settings:
        cli += ["--top-p", str(settings["top_p"]), "--seed", str(settings["seed"]), "--top-k", "40"]
    generated = run_cli("generate", tiny_artifact, "--prompt", "ROMEO:", "--max-new-tokens", "40", "--json", *cli)
    assert generated.returncode == 0, generated.stderr
    expected = json.loads(generated.stdout)
    extra = {"top_k": 40} if "seed" in settings else {}

    whole = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=40, extra_body=extra, **settings)
    assert whole.choices[0].text == expected["text"]
    assert whole.usage.prompt_tokens == expected["stats"]["prompt_tokens"]
    assert whole.usage.completion_tokens == len(expected["ids"]) and whole.usage.total_tokens == 5 + len(expected["ids"])
    assert whole.choices[0].finish_reason == ("length" if expected["stats"]["stop_reason"] == "max_new_tokens" else "stop")

    chunks = list(client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=40, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra, **settings))
    assert len({c.id for c in chunks}) == 1 and len(chunks) > 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected["ids"])


def test_token_id_prompt_and_stop_strings(server, client, engine):
    ids = engine.encode("KING HENRY:\n")
    plain = engine.generate(ids, max_new_tokens=60, stop_at_eos=False)
    assert "\n\n" in plain.text  # so the stop string below really cuts
    expected = engine.generate(ids, max_new_tokens=60, stop=["\n\n"], stop_at_eos=False)
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=60, temperature=0, stop="\n\n",
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "stop"
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(expected.ids)
    streamed = client.completions.create(model="tiny", prompt=ids, max_tokens=60, temperature=0, stop=["\n\n", "@@"],
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected.text  # no part of "\n\n" leaks


def test_chat_through_the_template(server, client, engine):
    messages = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "Who goes there?"}]
    prompt = "<|system|>\nSpeak as a king.\n<|user|>\nWho goes there?\n<|assistant|>\n"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
    expected = engine.generate(ids, max_new_tokens=30, **SEEDED)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=30, **SEEDED)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(expected.ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}, **SEEDED))
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.prompt_tokens == len(ids)


def _steps_by_batch(server) -> dict[int, float]:
    prefix = 'speedc_engine_steps_total{sequences="'
    return {int(name[len(prefix):-2]): value for name, value in server.metrics().items() if name.startswith(prefix)}


def test_eight_concurrent_async_streams(server, engine):
    """Eight streams at once, each equal to its own `generate`; they ran batched: engine steps decoded
    several of them together (the step tally, not timing)."""
    before = _steps_by_batch(server)
    prompts = ["ROMEO:", "JULIET:\n", "KING:", "First Citizen:", "O ", "What", "HAMLET:\n", "Enter"]
    settings = [GREEDY if i % 2 else dict(SEEDED, seed=i) for i in range(8)]

    async def one(client, prompt, setting) -> tuple[str, int]:
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=48, stream=True,
                                                 stream_options={"include_usage": True}, **setting)
        text, usage = [], None
        async for chunk in stream:
            text.extend(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return "".join(text), usage.completion_tokens

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in zip(prompts, settings)))

    results = asyncio.run(all_of_them())
    for prompt, setting, (text, completion_tokens) in zip(prompts, settings, results):
        expected = engine.generate(prompt, max_new_tokens=48, **setting)
        assert (text, completion_tokens) == (expected.text, len(expected.ids)), prompt
    after = _steps_by_batch(server)
    shared = {n: after[n] - before.get(n, 0) for n in after if n > 1 and after[n] > before.get(n, 0)}
    assert shared and max(shared) <= 8, after  # some steps decoded 2..8 of the streams together
    assert _ongoing_request_gauges_are_zero(server)


def _ongoing_request_gauges_are_zero(server) -> bool:
    server.wait_metric("speedc_requests_running", lambda v: v == 0)
    metrics = server.metrics()
    return metrics["speedc_requests_running"] == 0 and metrics["speedc_requests_waiting"] == 0


def test_disconnect_mid_stream_cancels_and_frees_the_engine(server, client):
    before = server.metrics()
    body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        # leaving the block closes the connection mid-stream
    cancelled = server.wait_metric("speedc_requests_cancelled_total", lambda v: v > before["speedc_requests_cancelled_total"])
    assert cancelled == before["speedc_requests_cancelled_total"] + 1
    assert _ongoing_request_gauges_are_zero(server)
    generated = server.metrics()["speedc_generation_tokens_total"] - before["speedc_generation_tokens_total"]
    assert 1 <= generated < 480  # the decoding stopped early

    # Not streaming: the client gives up waiting (read timeout closes the connection).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=dict(body, stream=False), timeout=httpx.Timeout(10, read=0.02))
    assert server.wait_metric("speedc_requests_cancelled_total", lambda v: v > cancelled) == cancelled + 1
    assert _ongoing_request_gauges_are_zero(server)
    gone = 'speedc_request_outcomes_total{outcome="cancelled",reason="",status="499"}'  # both, by outcome
    assert server.wait_metric(gone, lambda v: v >= before.get(gone, 0) + 2) == before.get(gone, 0) + 2
    # The engine is free: the next request runs to its end.
    assert client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=5, temperature=0).usage.completion_tokens == 5


BAD_REQUESTS = [
    ("completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("completions", b'["tiny"]', 400, None),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": "tiny", "prompt": "x", "stop": 5}, 400, "stop"),
    ("completions", {"model": "tiny", "prompt": 7}, 400, "prompt"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [5] * 600}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [5] * 500, "max_tokens": 100}, 400, "max_tokens"),
    # 5 M characters: refused before tokenizing (it took 6 s, and every other stream stalled behind it)
    ("completions", {"model": "tiny", "prompt": "ROMEO: " * 500_000}, 400, "prompt"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 3_000_000}]}, 400, "messages"),
    ("completions", {"model": "tiny", "prompt": [5, 99999]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 17}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("completions", {"model": "tiny", "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("completions", {"model": "tiny", "prompt": "x", "echo": "yes"}, 400, "echo"),
    ("completions", {"model": "tiny", "prompt": "x", "suffix": "!"}, 400, "suffix"),
    ("completions", {"model": "tiny", "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"model": "tiny", "prompt": "x", "presence_penalty": "lots"}, 400, "presence_penalty"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("completions", {"model": "tiny", "prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("completions", {"model": "tiny", "prompt": "x", "colour": "blue"}, 400, "colour"),
    ("completions", {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": "tiny", "prompt": "x", "seed": -1}, 400, "seed"),
    ("chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 1},
     400, "logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "echo": True},
     400, "echo"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    # lone surrogates (valid JSON escapes, no UTF-8 for them): a 500 from the tokenizer before
    ("completions", b'{"model": "tiny", "prompt": "caf\\udce9"}', 400, "prompt"),
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\\ud800"}]}', 400, "messages"),
    ("completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', 400, "stop"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, "messages"),  # no content
    ("completions", b'{"model": "tiny", "prompt": "x", "temperature": 1e400}', 400, "temperature"),  # param was prompt
    ("completions", b'{"model": "tiny", "prompt": "x", "top_p": NaN}', 400, "top_p"),
    ("completions", b"[" * 5000 + b"]" * 5000, 400, None),  # nested too deeply for the parser: was a 500
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    before = server.metrics()
    with httpx.Client(base_url=f"{server.url}/v1", timeout=30) as http:
        for route, body, status, param in BAD_REQUESTS:
            sent = (http.post(f"/{route}", content=body, headers={"content-type": "application/json"})
                    if isinstance(body, bytes) else http.post(f"/{route}", json=body))
            assert sent.status_code == status, (body, sent.text)
            error = sent.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], sent.text
            assert error["param"] == param, (body, error)
        assert http.get("/completions").status_code == 405 and "error" in http.get("/completions").json()
        usage_null = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": None}}
        assert http.post("/completions", json=usage_null).status_code == 200  # null means the default
        assert http.post("/nothing", json={}).status_code == 404
    with pytest.raises(openai.BadRequestError, match="n must be in 1..16"):
        client.completions.create(model="tiny", prompt="x", n=17)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    after = server.metrics()
    refused = sum(1 for _, _, status, _ in BAD_REQUESTS if status == 400) + 1

    def counted(samples):
        return sum(v for k, v in samples.items() if k.startswith("speedc_request_outcomes_total{") and 'status="400"' in k)
    assert counted(after) - counted(before) == refused
    assert after["speedc_requests_running"] == 0 and after["speedc_requests_waiting"] == 0
    ok = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
