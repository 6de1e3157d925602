"""A `speedc serve` subprocess on a free loopback port, for the server's tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path) -> None:
        self.process, self.port, self.log = process, port, log
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, seconds: float = 90, starting: tuple[int, ...] = (503,)) -> None:
        """Poll /health until 200; before that it may only answer STARTING (503: loading)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"speedc serve exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None  # not listening yet
            assert status is None or status == 200 or status in starting, status
            if status == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"speedc serve not ready after {seconds} s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        """{sample name with labels: value}, e.g. 'speedc_requests_finished_total{finish_reason="length"}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return samples

    def wait_metric(self, name: str, predicate, seconds: float = 10) -> float:
        deadline = time.monotonic() + seconds
        while True:
            value = self.metrics().get(name, 0.0)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.02)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(artifact: Path, folder: Path, *args: str, starting: tuple[int, ...] = (503,)) -> Server:
    """`speedc serve ARTIFACT` (one engine thread, warnings only in its log), ready to answer."""
    port = free_port()
    log = folder / f"serve-{port}.log"
    exe = Path(sys.executable).with_name("speedc")
    with open(log, "w") as out:
        process = subprocess.Popen([str(exe), "serve", str(artifact), "--port", str(port), "--threads", "1",
                                    "--log-level", "warning", *args], stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, port, log)
    try:
        server.wait_ready(starting=starting)
    except BaseException:
        server.stop()
        raise
    return server


@contextmanager
def server_in_this_process(settings) -> Iterator[str]:
    """create_app(SETTINGS) on uvicorn in a thread of the test process (cheaper than a subprocess when
    a test needs a server with unusual settings); yields its URL."""
    import uvicorn

    from speedc.serve.app import create_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)  # not the main thread: uvicorn leaves signals alone
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not (server.started and httpx.get(f"{url}/health", timeout=2).status_code == 200):
            assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
