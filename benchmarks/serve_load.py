"""Load on `speedc serve`: N concurrent streaming clients for T seconds on loopback.

    python benchmarks/serve_load.py --artifact out/small --clients 16 --seconds 60   # starts the server
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model small        # a running one

Each client sends streaming completions back to back (seeded sampling, prompts cycled, usage asked
for) until the time is up; requests started before then run to their end. Reported: requests/s,
generated tokens/s, time to first token p50/p99 (request sent -> first text), inter-token latency
p50/p99 (between text chunks), and errors by kind (HTTP status, error event, transport). Counts
and time are bounded (--clients <= 256, --seconds <= 600). --json prints the numbers as one object.
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


def start_server(artifact: Path, clients: int, threads: int | None,
                 max_batch: int | None) -> tuple[subprocess.Popen, str, str]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exe = Path(sys.executable).with_name("speedc")
    args = [str(exe), "serve", str(artifact), "--port", str(port), "--max-queue", str(clients), "--log-level", "warning"]
    if threads:
        args += ["--threads", str(threads)]
    if max_batch:
        args += ["--max-batch", str(max_batch)]
    log = tempfile.NamedTemporaryFile("w", prefix="speedc-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
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
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not 1 <= args.clients <= 256 or not 0 < args.seconds <= 600 or not 1 <= args.max_tokens <= 4096:
        sys.exit("error: --clients must be 1..256, --seconds in (0, 600], --max-tokens 1..4096")
    process = None
    if args.artifact:
        process, url, model = start_server(args.artifact, args.clients, args.threads, args.max_batch)
    else:
        url = args.url.rstrip("/")
        model = args.model or httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    try:
        result = asyncio.run(run_load(url, model, args.clients, args.seconds, args.max_tokens))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>20}: {value}")


if __name__ == "__main__":
    main()
