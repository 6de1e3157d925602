"""Bad, huge and aborted requests against `speedc serve` while normal streams run, in one run:

    speedc build zoo:small -o out/small
    python benchmarks/serve_abuse.py --artifact out/small --threads 2

First a normal load (4 streams of 900 tokens, 3 JSON-schema requests, 2 prompts of 1,020 tokens scored
with echo); the server's RSS after it is the reference. Then each case, with 2 normal streams running:
grammars too big for llguidance's lexer or parser, 2,500 and 100,000 choices, an enum of 1,000,000, a $ref
cycle, bodies of 50 MB, 300 MB and 4 x 200 MB, text/plain, 2,000 uploads aborted part way, and a
1,020-token prompt scored with echo beside a new request. Reported per case: the answer, its seconds,
the longest gap between two events of the normal streams meanwhile, the server's RSS; then the RSS
against the reference, the outcome metrics, and tracebacks / ERROR lines in the server's log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import httpx

from serve_load import start_server

CASES = {
    "pattern (a{1000}){1000}": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}},
    "guided_grammar: a rule of 2,500 alternatives": {
        "guided_grammar": "start: " + " | ".join(json.dumps(f"item{i}") for i in range(2500))},
    "guided_choice of 2,500": {"guided_choice": [f"item{i}" for i in range(2500)]},
    "guided_choice of 100,000 (1.2 MB)": {"guided_choice": [f"choice {i}" for i in range(100_000)]},
    "enum of 1,000,000": {"guided_json": {"enum": [f"v{i}" for i in range(1_000_000)]}},
    "$ref cycle a -> b -> a": {"guided_json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                               "$ref": "#/$defs/a"}},
}
UPLOAD = """
import sys, threading, httpx
url, megabytes, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = b'{"prompt": "' + b"x" * (megabytes << 20) + b'"}'
statuses = []
def send():
    statuses.append(httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                               timeout=600).status_code)
threads = [threading.Thread(target=send) for _ in range(count)]
[t.start() for t in threads]
[t.join() for t in threads]
print(" ".join(map(str, statuses)))
"""
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


async def stream(http: httpx.AsyncClient, model: str, prompt: str, tokens: int, gaps: list) -> None:
    last = None
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append((now, now - last))
                last = now


async def run(url: str, model: str, pid: int, context: int, port: int) -> None:
    scored = list(range(5, 5 + min(1020, context - 2)))
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        def post(body: dict):
            return http.post("/v1/completions", json={"model": model, **body})

        gaps: list = []
        await asyncio.gather(*[stream(http, model, p, 900, gaps) for p in ("ROMEO:", "JULIET:", "HAMLET:", "O, ")])
        for _ in range(3):
            await post({"prompt": "ROMEO:", "max_tokens": 40, "guided_json": SCHEMA})
        await asyncio.gather(*[post({"prompt": scored, "max_tokens": 1, "echo": True, "logprobs": 1}) for _ in range(2)])
        reference = rss_mb(pid)
        print(f"RSS after a normal load: {reference:.0f} MB; its longest stream gap {max(g for _, g in gaps) * 1e3:.0f} ms")
        print("| case | answer | seconds | longest stream gap meanwhile | RSS |\n|---|---|---|---|---|")

        async def beside_streams(name: str, work) -> None:
            gaps: list = []
            streams = [asyncio.ensure_future(stream(http, model, p, 900, gaps)) for p in ("ROMEO:", "JULIET:")]
            await asyncio.sleep(0.5)
            start = time.perf_counter()
            answer = await work
            end = time.perf_counter()
            for task in streams:
                task.cancel()
            during = [gap for at, gap in gaps if start <= at <= end + 1]
            print(f"| {name} | {answer} | {end - start:.2f} | {max(during, default=0) * 1e3:.0f} ms | {rss_mb(pid):.0f} MB |",
                  flush=True)

        def answer(response: httpx.Response) -> str:
            if response.status_code == 200:
                return "200"
            error = response.json()["error"]
            return f"{response.status_code} {error['code'] or error['type']}: {error['message'][:70]}"

        for name, fields in CASES.items():
            async def one(fields=fields):
                return answer(await post({"prompt": "ROMEO:", "max_tokens": 8, **fields}))
            await beside_streams(name, one())

        async def big(megabytes: int, count: int = 1):
            """COUNT bodies of MEGABYTES sent at once from another process (sending them from this one would pause
            its own reading of the streams)."""
            sender = await asyncio.create_subprocess_exec(sys.executable, "-c", UPLOAD, url, str(megabytes), str(count),
                                                          stdout=asyncio.subprocess.PIPE)
            return (await sender.communicate())[0].decode().strip()
        for megabytes, count in ((50, 1), (300, 1), (200, 4)):
            await beside_streams(f"{count} x {megabytes} MB body", big(megabytes, count))

        async def text_plain():
            return answer(await http.post("/v1/completions", content=b'{"model": "x", "prompt": "x"}',
                                          headers={"content-type": "text/plain"}))
        await beside_streams("text/plain", text_plain())

        def aborted(count: int = 2000) -> str:
            for _ in range(count):
                with socket.create_connection(("127.0.0.1", port)) as raw:
                    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"x" * 2000)
            return f"{count} sent"
        await beside_streams("2,000 uploads aborted part way", asyncio.to_thread(aborted))

        async def first_token() -> float:
            start = time.perf_counter()
            body = {"model": model, "prompt": "ROMEO:", "max_tokens": 8, "stream": True, "temperature": 0}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        return time.perf_counter() - start
        alone = min([await first_token() for _ in range(3)])
        start = time.perf_counter()
        echo = asyncio.ensure_future(post({"prompt": scored, "max_tokens": 1, "echo": True, "logprobs": 1}))
        await asyncio.sleep(1.0)
        beside = await first_token()
        done = await echo
        print(f"echo + logprobs of {len(scored)} tokens: {answer(done)} in {time.perf_counter() - start:.1f} s; a new "
              f"request's first token {beside:.3f} s beside it ({alone:.3f} s alone)")
        final = rss_mb(pid)
        print(f"RSS after the cases: {final:.0f} MB, {final / reference:.2f}x the normal load's")
        metrics = (await http.get("/metrics")).text
        print("\n".join(line for line in metrics.splitlines()
                        if line.startswith(("speedc_request_outcomes_total", "speedc_stream_failures_total"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    process, url, model = start_server(args.artifact, 4, args.threads, None, log_level="info")
    try:
        context = httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        asyncio.run(run(url, model, process.pid, context, int(url.rsplit(":", 1)[1])))
    finally:
        process.terminate()
        process.wait()
    log = Path(process.log_name).read_text()
    print(f"server log: {log.count(chr(10))} lines, {log.count('Traceback')} tracebacks, {log.count('ERROR')} ERROR lines")


if __name__ == "__main__":
    main()
