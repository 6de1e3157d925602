"""`speedc bench` runs briefly on the tiny model and reports its fields (never asserts a speed)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_bench_json_fields(tiny_artifact):
    result = run_cli("bench", tiny_artifact, "--new-tokens", "16", "--repeats", "1", "--prompt", "ROMEO:",
                     "--prompt", "JULIET:", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical_ids"] is True  # checked before any speed is reported
    for key in ("ms_per_token", "tokens_per_second", "speedup_p50", "acceptance_rate", "tokens_per_step", "step_cost",
                "bound", "achieved_over_bound", "prefill_ms_p50"):
        assert key in report
    assert set(report["ms_per_token"]) == {"speed", "autoregressive"} and report["repeats"] == 2
    # Peers ran on the same weights (their ids were checked against SPEED's inside the bench).
    peers = {"pytorch-reference", "transformers", "onnxruntime-genai"}  # the dev extra installs all three
    assert set(report["e2e_ms_per_token"]) == {"speed", "autoregressive", *peers}
    assert set(report["speed_speedup_e2e"]) == {"autoregressive", *peers}
    assert report["weight_bytes"]["speedc"] < report["weight_bytes"]["onnxruntime-genai"]
    assert 0 <= report["acceptance_rate"] <= 1 and report["step_cost"] > 0


def test_memory_bound_step_cost_rows():
    """The memory-bound mode (here shrunk to hidden 64 so CI stays fast) reports c(P) rows only."""
    result = run_cli("bench", "--memory-bound", "--memory-bound-hidden", "64", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["label"].startswith("step cost only")
    assert [row["slots"] for row in report["rows"]] == [2, 4] and all(row["step_cost"] > 0 for row in report["rows"])
