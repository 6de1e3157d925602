"""Load on `speedc serve`: N concurrent streaming clients for T seconds on loopback.

    python benchmarks/serve_load.py --artifact out/small --clients 16 --seconds 60   # starts the server
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model small        # a running one

Each client sends streaming completions back to back (seeded sampling, prompts cycled, usage asked
for) until the time is up; requests started before then run to their end. Reported: requests/s,
generated tokens/s, time to first token p50/p99 (request sent -> first text), inter-token latency
p50/p99 (between text chunks), and errors by kind (HTTP status, error event, transport). Counts
and time are bounded (--clients <= 256, --seconds <= 600). --json prints the numbers as one object.

--mixed: the clients send a mix of the API's features instead (MIXED_BODIES: log-probabilities, echo,
n, penalties, logit_bias, a JSON schema, chats that continue one another through the prefix cache,
streamed and whole), each seeded; afterwards every distinct request is sent again alone, and each answer
under load must equal it: "mismatched" counts the answers that differ (a mixed-up request), "lost"
those that failed or did not finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPTS = ["ROMEO:", "JULIET:\n", "KING HENRY:\n", "First Citizen:\n", "HAMLET:", "Enter", "O, ", "What say you"]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Tally:
    def __init__(self) -> None:
        self.requests, self.tokens = 0, 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.errors: Counter = Counter()


async def one_request(http: httpx.AsyncClient, body: dict, tally: Tally) -> None:
    sent = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                tally.errors[f"HTTP {response.status_code}"] += 1
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.errors[f"error event: {chunk['error'].get('type')}"] += 1
                    return
                if chunk.get("usage"):
                    tally.tokens += chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        tally.ttft.append(now - sent)
                    else:
                        tally.itl.append(now - last)
                    last = now
        tally.requests += 1
    except httpx.HTTPError as failed:
        tally.errors[f"transport: {type(failed).__name__}"] += 1


async def client_loop(index: int, url: str, model: str, max_tokens: int, until: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300)) as http:
        sent = 0
        while time.perf_counter() < until:
            body = {"model": model, "prompt": PROMPTS[(index + sent) % len(PROMPTS)], "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": index * 100003 + sent, "stream": True,
                    "stream_options": {"include_usage": True}}
            await one_request(http, body, tally)
            sent += 1


async def run_load(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    tally = Tally()
    started = time.perf_counter()
    await asyncio.gather(*(client_loop(i, url, model, max_tokens, started + seconds, tally) for i in range(clients)))
    elapsed = time.perf_counter() - started
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": tally.requests,
            "requests_per_second": round(tally.requests / elapsed, 2), "tokens_per_second": round(tally.tokens / elapsed, 1),
            "ttft_ms_p50": ms(percentile(tally.ttft, 0.5)), "ttft_ms_p99": ms(percentile(tally.ttft, 0.99)),
            "itl_ms_p50": ms(percentile(tally.itl, 0.5)), "itl_ms_p99": ms(percentile(tally.itl, 0.99)),
            "errors": sum(tally.errors.values()), "errors_by_kind": dict(tally.errors)}


HISTORY = "You are the king's herald. Answer in the manner of the court. " * 6
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def mixed_body(k: int, model: str, max_tokens: int) -> tuple[str, dict]:
    """The k-th of MIXED_BODIES distinct requests: (route, body), each deterministic (seeded)."""
    prompt, seed = PROMPTS[k % len(PROMPTS)], 1000 + k
    kind = k % 7
    if kind == 0:
        return "completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                               "seed": seed, "logprobs": 2, "stream": k % 2 == 0}
    if kind == 1:
        return "completions", {"model": model, "prompt": prompt + " and so", "max_tokens": 0, "echo": True,
                               "logprobs": 1}
    if kind == 2:
        return "completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                               "seed": seed, "n": 3}
    if kind == 3:
        return "completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7,
                               "seed": seed, "presence_penalty": 0.8, "frequency_penalty": 0.5,
                               "logit_bias": {"5": 3.0, "7": -100}, "stream": True}
    if kind == 4:
        return "completions", {"model": model, "prompt": prompt, "max_tokens": 96, "temperature": 0,
                               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    turns = [{"role": "system", "content": HISTORY}, {"role": "user", "content": prompt}]
    if kind == 6:  # a later turn of the same conversation: its prompt begins with kind 5's
        turns += [{"role": "assistant", "content": "My lord."}, {"role": "user", "content": "Say more."}]
    return "chat/completions", {"model": model, "messages": turns, "max_tokens": max_tokens, "temperature": 0.6,
                                "seed": seed, "logprobs": True, "top_logprobs": 1, "stream": kind == 6}


MIXED_BODIES = 42


async def send_mixed(http: httpx.AsyncClient, route: str, body: dict) -> tuple | str:
    """The answer's content (texts and log-probabilities by choice) or why it failed."""
    texts: dict[int, list] = {}
    try:
        if not body.get("stream"):
            response = await http.post(f"/v1/{route}", json=body)
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            for choice in response.json()["choices"]:
                text = choice["text"] if "text" in choice else choice["message"]["content"]
                texts[choice["index"]] = [text, json.dumps(choice["logprobs"])]
            return tuple(tuple(texts[i]) for i in sorted(texts))
        done = False
        async with http.stream("POST", f"/v1/{route}", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return f"error event: {chunk['error'].get('type')}"
                for choice in chunk["choices"]:
                    text = choice["text"] if "text" in choice else choice["delta"].get("content") or ""
                    entry = texts.setdefault(choice["index"], ["", []])
                    entry[0] += text
                    if choice.get("logprobs"):
                        entry[1].append(choice["logprobs"])
        if not done:
            return "stream without [DONE]"
        return tuple((texts[i][0], json.dumps(texts[i][1])) for i in sorted(texts))
    except httpx.HTTPError as failed:
        return f"transport: {type(failed).__name__}"


async def run_mixed(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    answers: dict[int, list] = {}
    started = time.perf_counter()

    async def client(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300)) as http:
            sent = 0
            while time.perf_counter() < started + seconds:
                k = (index * 7 + sent) % MIXED_BODIES
                answers.setdefault(k, []).append(await send_mixed(http, *mixed_body(k, model, max_tokens)))
                sent += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    lost, mismatched, requests = Counter(), 0, sum(len(v) for v in answers.values())
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300)) as http:
        for k, got in sorted(answers.items()):
            alone = await send_mixed(http, *mixed_body(k, model, max_tokens))
            for answer in got:
                if isinstance(answer, str):
                    lost[answer] += 1
                elif answer != alone:
                    mismatched += 1
    return {"clients": clients, "seconds": round(elapsed, 2), "requests": requests,
            "requests_per_second": round(requests / elapsed, 2), "distinct_requests": len(answers),
            "lost": sum(lost.values()), "lost_by_kind": dict(lost), "mismatched": mismatched}


# --mixed on an artifact without a chat template: the server gets this one (ChatML's shape)
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def start_server(artifact: Path, clients: int, threads: int | None,
                 max_batch: int | None, chat_template: Path | None = None,
                 log_level: str = "warning") -> tuple[subprocess.Popen, str, str]:
    """(the `speedc serve` process, its URL, the model id); process.log_name: the file its output goes to."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exe = Path(sys.executable).with_name("speedc")
    # room for every client's request to wait, n choices each (--mixed asks for 3)
    args = [str(exe), "serve", str(artifact), "--port", str(port), "--max-queue", str(3 * clients), "--log-level", log_level]
    if threads:
        args += ["--threads", str(threads)]
    if max_batch:
        args += ["--max-batch", str(max_batch)]
    if chat_template:
        args += ["--chat-template", str(chat_template)]
    log = tempfile.NamedTemporaryFile("w", prefix="speedc-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    process.log_name = log.name
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url, Path(artifact).resolve().name
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    sys.exit(f"error: the server did not become ready (log: {log.name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--artifact", type=Path, help="Start `speedc serve` on this artifact (a free loopback port).")
    where.add_argument("--url", help="A running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="Model id (with --url; default: the server's only model).")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="--artifact: the server's engine threads.")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="--artifact: the server's --max-batch (default: its own; 1: one request at a time).")
    parser.add_argument("--mixed", action="store_true", help="A mix of the API's features, each answer checked "
                                                             "against the same request sent alone.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 600 or not 1 <= args.max_tokens <= 4096:
        sys.exit("error: --clients must be 1..256, --seconds in (0, 600], --max-tokens 1..4096")
    process = None
    if args.artifact:
        template = None
        from speedc.serve.chat_template import load_chat_template

        if args.mixed and load_chat_template(args.artifact) is None:
            template = Path(tempfile.mkdtemp()) / "chat.jinja"
            template.write_text(PLAIN_CHAT_TEMPLATE)
        process, url, model = start_server(args.artifact, args.clients, args.threads, args.max_batch, template)
    else:
        url = args.url.rstrip("/")
        model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    try:
        run = run_mixed if args.mixed else run_load
        result = asyncio.run(run(url, model, args.clients, args.seconds, args.max_tokens))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")
    if args.mixed and (result["lost"] or result["mismatched"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
