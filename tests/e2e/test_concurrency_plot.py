"""`speedc bench concurrency ... --plot`: a concurrency report drawn to PNG (no benchmark run), and a bad
plot path refused before any measuring."""

from __future__ import annotations

from conftest import assert_one_line_error, run_cli
from speedc.bench.plot import write_concurrency_plot

PNG = b"\x89PNG\r\n\x1a\n"


def _report() -> dict:
    rows = []
    for clients in (1, 2, 4, 8):
        for system, rate in (("speed-adaptive", 30.0), ("speed-always", 28.0), ("plain-batched", 20.0),
                             ("onnxruntime-genai", 25.0)):
            rows.append({"clients": clients, "system": system, "tokens_per_second": rate * clients ** 0.7,
                         "ms_per_token_p50": 1000 / rate * clients ** 0.3, "ms_per_token_p99": 90.0, "ttft_ms_p50": 5.0,
                         "steps": {}})
    return {"artifact": "/tmp/out/small", "slots": 4, "new_tokens": 64, "repeats": 2, "identical_ids": True,
            "concurrency": rows}


def test_concurrency_report_draws_a_png(tmp_path):
    path = write_concurrency_plot(_report(), tmp_path / "sub" / "concurrency.png")
    assert path.read_bytes()[:8] == PNG and not list(path.parent.glob(".*partial*"))


def test_concurrency_plot_path_checked_before_measuring(tiny_artifact, tmp_path):
    result = run_cli("bench", "concurrency", tiny_artifact, "--clients", "1,2", "--plot", tmp_path / "c.jpg")
    assert_one_line_error(result, "give a .png file name")
