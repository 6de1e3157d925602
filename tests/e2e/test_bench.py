"""`speedc bench artifact | memory-bound | concurrency` run briefly on the tiny model and report their fields
(never asserting a speed)."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, run_cli


def test_bench_json_fields(tiny_artifact):
    result = run_cli("bench", "artifact", tiny_artifact, "--new-tokens", "16", "--repeats", "1", "--prompt", "ROMEO:",
                     "--prompt", "JULIET:", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical_ids"] is True  # checked before any speed is reported
    for key in ("ms_per_token", "tokens_per_second", "speedup_p50", "acceptance_rate", "tokens_per_step", "step_cost",
                "bound", "achieved_over_bound", "prefill_ms_p50", "flushes"):
        assert key in report
    assert set(report["ms_per_token"]) == {"speed", "speed-always", "autoregressive"} and report["repeats"] == 2
    policy = report["policy"]  # the default mode's decisions and the costs it measured here
    assert policy["speed_steps"] + policy["plain_steps"] > 0 and policy["step_cost"] > 0 and report["speedup_always_p50"] > 0
    assert policy["host_costs"]["slots"] == 4
    # Each speedup also under a name that says what it measures; the old keys stay.
    assert report["speedup_decode_p50"] == report["speedup_p50"]
    assert report["speedup_e2e_p50"] == report["speed_speedup_e2e"]["autoregressive"]
    # Peers: three on the artifact's weights (their ids were required equal to SPEED's inside the bench)
    # and ORT GenAI's int4 export (other weights: its agreement with SPEED's ids is reported).
    same = {"pytorch-reference", "transformers", "onnxruntime-genai"}
    peers = {*same, "onnxruntime-genai-int4"}  # the dev extra installs all four
    assert set(report["e2e_ms_per_token"]) == {"speed", "speed-always", "autoregressive", *peers}
    assert set(report["speed_speedup_e2e"]) == {"speed-always", "autoregressive", *peers}
    assert report["weight_bytes"]["speedc"] < report["weight_bytes"]["onnxruntime-genai"]
    assert 0 < report["weight_bytes"]["onnxruntime-genai-int4"] < report["weight_bytes"]["onnxruntime-genai"] / 4
    agreement = report["peer_agreement"]
    assert set(agreement) == peers
    for name in same:
        assert agreement[name] == {"same_weights": True, "identical_ids": True, "agreement": 1.0, "prefix_agreement": 1.0}
    int4 = agreement["onnxruntime-genai-int4"]
    assert int4["same_weights"] is False and 0 <= int4["prefix_agreement"] <= int4["agreement"] <= 1
    assert int4["identical_ids"] == (int4["prefix_agreement"] == 1)
    assert 0 <= report["acceptance_rate"] <= 1 and report["step_cost"] > 0
    assert set(report["flushes"]) == {"last_layer", "early", "tokens_discarded"}
    # Peak RSS, each system in its own process: the ONNX Runtime paths (speedc's, GenAI's) never import
    # torch, the PyTorch reference and transformers do.
    assert set(report["peak_rss_mb"]) == {"speed", "autoregressive", *peers}
    assert 0 < report["peak_rss_mb"]["speed"] < report["peak_rss_mb"]["pytorch-reference"]
    assert 0 < report["peak_rss_mb"]["onnxruntime-genai-int4"] < report["peak_rss_mb"]["pytorch-reference"]


def test_modes_take_turns_running_first_and_after_each_other():
    """Six rounds run every order of three modes: each mode first (and last) twice, and right after each other
    mode twice."""
    from collections import Counter

    from speedc.bench.run import mode_order

    modes = ("speed", "speed-always", "autoregressive")
    orders = [mode_order(modes, turn) for turn in range(6)]
    assert len(set(orders)) == 6 and all(sorted(order) == sorted(modes) for order in orders)
    assert Counter(order[0] for order in orders) == Counter(modes * 2)
    assert Counter(pair for order in orders for pair in zip(order, order[1:])) == {
        (a, b): 2 for a in modes for b in modes if a != b}
    assert mode_order(modes, 6) == orders[0]


def test_peer_ids_refused_or_compared(tiny_artifact, capsys, monkeypatch):
    """A scripted stand-in peer returns plain decoding's ids with one token changed: on the artifact's
    weights (must_match) the bench refuses to report; at another precision it reports the agreement
    (every position but one equal) and the prefix (the positions before the change)."""
    from speedc.bench.peers import LoadedPeer
    from speedc.bench.run import run_bench
    from speedc.errors import SpeedcError
    from speedc.runtimes.engine import Engine

    engine = Engine.load(tiny_artifact)
    prompt, new_tokens, changed = "ROMEO:", 8, 5
    plain = engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode="autoregressive").ids
    wrong = [*plain[:changed], (plain[changed] + 1) % engine.manifest.model["vocab_size"], *plain[changed + 1:]]

    def stand_in(ids: list[int], tokens: int) -> list[int]:
        assert ids == engine.encode(prompt) and tokens == new_tokens
        return wrong

    with pytest.raises(SpeedcError, match="stand-in runs the artifact's weights but produced different ids"):
        run_bench(engine, prompts=[prompt], new_tokens=new_tokens, repeats=1, peers={"stand-in": LoadedPeer(stand_in, True)})
    report = run_bench(engine, prompts=[prompt], new_tokens=new_tokens, repeats=2,
                       peers={"stand-in": LoadedPeer(stand_in, False), "echo": LoadedPeer(lambda ids, n: plain, True)})
    assert report.identical_ids and set(report.speed_speedup_e2e) == {"speed-always", "autoregressive", "stand-in", "echo"}
    assert report.peer_agreement == {
        "stand-in": {"same_weights": False, "identical_ids": False, "agreement": round(7 / 8, 4), "prefix_agreement": 5 / 8},
        "echo": {"same_weights": True, "identical_ids": True, "agreement": 1.0, "prefix_agreement": 1.0}}
    # The table says which ids were required equal and shows the others' agreement.
    from speedc.cli.bench import print_report

    monkeypatch.setenv("COLUMNS", "200")
    print_report(report, tiny_artifact, new_tokens)
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")}
    assert "agreement 0.875, prefix 0.625" in rows["stand-in"]
    assert "identical (required)" in rows["echo"] and "identical (required)" in rows["autoregressive"]


def test_which_peers_must_match(tiny_artifact):
    """fp32 peers run the artifact's own values: required equal on a float artifact. On a block-quantized
    artifact they run the dequantized values in fp32 (the artifact: int8 dot products), and GenAI int4
    re-quantizes: agreement reported, never required."""
    import dataclasses

    from speedc.format.artifact import read_manifest
    from speedc.bench.peers import PEERS

    manifest = read_manifest(tiny_artifact)
    assert {name: spec.same_weights(manifest) for name, spec in PEERS.items()} == {
        "pytorch-reference": True, "transformers": True, "onnxruntime-genai": True, "onnxruntime-genai-int4": False}
    for dtype in ("fp16", "bf16"):  # stored 16-bit, widened to fp32 exactly: the same values
        assert PEERS["transformers"].same_weights(dataclasses.replace(manifest, dtype=dtype))
    for dtype in ("int8", "int4"):
        assert not any(spec.same_weights(dataclasses.replace(manifest, dtype=dtype)) for spec in PEERS.values())


def test_bench_sweeps_and_plot(tiny_artifact, tmp_path):
    """--sweep slots recompiles at every P the layer map allows; --sweep length fills the context up to
    the model's limit; --plot writes a PNG. Fields only, never speeds."""
    plot = tmp_path / "bench.png"
    result = run_cli("bench", "artifact", tiny_artifact, "--new-tokens", "8", "--repeats", "1", "--prompt", "ROMEO:",
                     "--no-peers", "--no-memory", "--sweep", "slots", "--sweep", "length", "--plot", plot, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    slots = report["sweep"]["slots"]
    assert [row["slots"] for row in slots["rows"]] == [1, 2, 4]  # tiny: 2 blocks x 4 passes
    assert list(slots["skipped"]) == ["8"] and "allows P in [1, 2, 4]" in slots["skipped"]["8"]
    assert slots["rows"][0]["step_cost"] == 1.0 and slots["rows"][0]["acceptance"] == 0.0  # P=1: plain decoding
    assert all(row["acceptance"] > 0 and row["step_cost"] > 0 for row in slots["rows"][1:])
    length = report["sweep"]["length"]
    assert [row["context"] for row in length["rows"]] == [128, 256, 512]  # tiny's context is 512
    assert set(length["skipped"]) == {"1024", "2048"}
    for row in length["rows"]:  # beside the default mode: speculating throughout, and where the default mode ran plain
        assert row["speedup_always"] > 0 and row["speed_steps"] + row["plain_steps"] > 0
    assert report["peak_rss_mb"] == {}  # --no-memory
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*partial*"))


def test_bench_human_output_names_each_speedup(tiny_artifact):
    """Two speedups are printed: decode only (prefill excluded) and end to end (prefill + decode).
    Every table and line showing one says which (labels only, never speeds)."""
    result = run_cli("bench", "artifact", tiny_artifact, "--new-tokens", "8", "--repeats", "1", "--prompt", "ROMEO:",
                     "--no-peers", "--no-memory", "--sweep", "length", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    text = " ".join(result.stdout.split())  # titles wrap to their table's width

    def line_with(fragment: str) -> str:  # headers and the summary line: one line each at 200 columns
        found = [line for line in lines if fragment in line]
        assert len(found) == 1, (fragment, result.stdout)
        return found[0]

    assert "per mode, decode only (prefill excluded)" in text  # the per-mode table's title
    assert "decode ms/token p50" in line_with("decode tokens/s")  # its header
    assert "per system, end to end (prefill + decode), ids against SPEED's" in text
    assert "ms/new token p50" in line_with("SPEED speedup, end to end")  # its header
    assert "ids vs SPEED" in line_with("SPEED speedup, end to end")
    assert sum("identical (required)" in line for line in lines) == 2  # speed-always, autoregressive: checked first
    summary = line_with("identical ids: True")
    assert "SPEED speedup, decode only (p50): " in summary and "end to end (p50): " in summary
    assert "speedup (p50)" not in text  # no unlabelled speedup left
    assert "decode-only speedup / bound" in line_with("analytic bound")
    assert "sweep length: decode only (prefill excluded)" in text
    assert "always: speculating at every step" in text


def test_bench_plot_needs_png(tiny_artifact, tmp_path):
    result = run_cli("bench", "artifact", tiny_artifact, "--no-peers", "--plot", tmp_path / "bench.jpg")
    assert_one_line_error(result, "--plot")
    assert not (tmp_path / "bench.jpg").exists()


def test_memory_bound_step_cost_rows(tiny_artifact):
    """The memory-bound mode (here shrunk to hidden 64 so CI stays fast) reports c(P) rows, each beside
    the weight floor's c(P) measured in the same run."""
    result = run_cli("bench", "memory-bound", "--hidden", "64", "--repeats", "5", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["label"].startswith("step cost only") and report["weights"] == "fp32"
    assert [row["slots"] for row in report["rows"]] == [2, 4]
    for row in report["rows"]:
        assert row["step_cost"] > 0 and row["floor_step_cost"] > 0 and row["floor_token_ms"] > 0
    bad = run_cli("bench", "artifact", str(tiny_artifact), "--profile")
    assert_one_line_error(bad, "--profile does not go with `speedc bench artifact`: it goes with `speedc bench memory-bound`")
    bad = run_cli("bench", "artifact", str(tiny_artifact), "--peer", "transformers", "--no-peers")
    assert_one_line_error(bad, "--peer and --no-peers contradict each other")


def test_step_op_profile(tiny_artifact):
    """--profile's table: the step's kernel time per op type beside the plain token's share."""
    from speedc.format.artifact import read_manifest
    from speedc.bench.op_profile import step_op_profile

    rows = step_op_profile(tiny_artifact, read_manifest(tiny_artifact), threads=1, context=64, repeats=5)
    ops = {row["op"]: row for row in rows}
    assert ops["Gemm"]["step_ms"] > 0 and ops["Gemm"]["token_share_ms"] > 0  # the weight products
    assert "GroupQueryAttention" in ops and "If" not in ops  # the fused graph; the If around a branch not counted
    assert [row["step_ms"] for row in rows] == sorted((row["step_ms"] for row in rows), reverse=True)


@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_weight_floor_graph_computes_the_chain(weights):
    """The floor graph is the blocks' weight products in order (each reading the columns the next
    projection would), P passes, then the head on the first rows: checked against numpy on the values
    its weights hold (quantized: the dequantized codes; MatMulNBits quantizes activations per block too,
    so to a tolerance). An int4 floor runs the artifact's extra zero row."""
    import numpy as np

    from speedc.bench.floor import block_products, floor_graph, floor_weights, _session
    from speedc.bench.synthetic import Shape
    from speedc.passes.block_quant import quantize_rows

    shape = Shape("t", 32, 4, 2, 8, 48, 50, 2, 3, looped=False)
    floor = floor_weights(shape, 2, weights)
    model = floor_graph(shape, layers=2, passes=3, head_rows=2, weights=floor)

    def matrix(name):  # what the product multiplies by
        if floor.bits is None:
            return floor.arrays[name]
        codes, scales = floor.arrays[f"{name}.codes"], floor.arrays[f"{name}.scales"]
        if floor.bits == 4:
            codes = np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:2], -1)
        values = (codes.astype(np.float32) - (1 << (floor.bits - 1))) * scales[..., None]
        return values.reshape(values.shape[0], -1)[:, :floor.products[name][1]]

    x = np.random.default_rng(1).standard_normal((3 + floor.pad_rows, 32)).astype(np.float32)
    if floor.pad_rows:
        x[-1] = 0
    expected = x
    for _ in range(3):
        for layer in range(2):
            for index, (_, _, passed_on) in enumerate(block_products(shape)):
                expected = (expected @ matrix(f"w{layer}.{index}").T)[:, :passed_on]
    expected = expected[:2 + floor.pad_rows] @ matrix("head").T
    actual = _session(model, floor, threads=1).run(None, {"x": x})[0]
    assert actual.shape == (2 + floor.pad_rows, shape.vocab)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-6 if floor.bits is None else 0.03 * scale)
    op = "Gemm" if floor.bits is None else "MatMulNBits"
    assert sum(node.op_type == op for node in model.graph.node) == 3 * 2 * 4 + 1
    if floor.bits:  # the codes are what the artifact's writer makes of the same values
        assert quantize_rows(matrix("head"), floor.bits, 32)[0].tobytes() == floor.arrays["head.codes"].tobytes()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_kernel_measurement_reports_every_row_count_beside_matmulnbits(weights):
    """The kernel part of `speedc bench memory-bound --weights int4|int8`: its fields (not its speed), and the
    kernel chain computing what the MatMulNBits chain does (the same products, two int8 kernels)."""
    import numpy as np

    from speedc.bench.floor import FloorWeights, _session, floor_graph, floor_weights, measure_kernel
    from speedc.bench.synthetic import Shape
    from speedc.runtimes.kernels import native

    shape = Shape("t", 64, 4, 2, 16, 96, 50, 2, 3, looped=False)
    report = measure_kernel(shape, 2, weights=weights, threads=2, repeats=2)
    if native.load() is None:
        assert report == {"kernel": None, "why": native.unavailable_reason()}
        return
    assert report["kernel"] == native.load().path and report["threads"] == 2
    assert report["kernel"] in report["paths"] and not set(native.STAND_INS) & set(report["paths"])
    assert all(set(p["rows_ms"]) == {"1", "2", "4", "8"} and p["one_row_vs_stream"] > 0 for p in report["paths"].values())
    assert set(report["rows_ms"]) == set(report["matmulnbits_rows_ms"]) == {"1", "2", "4", "8"}
    assert set(report["cost"]) == set(report["matmulnbits_cost"]) == {"2", "4", "8"}
    assert all(v > 0 for v in [*report["rows_ms"].values(), *report["matmulnbits_rows_ms"].values(), report["stream_ms"]])
    floor = floor_weights(shape, 2, weights)
    blocks = FloorWeights(floor.bits, {n: a for n, a in floor.arrays.items() if not n.startswith("head.")}, floor.products)
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    expected = _session(floor_graph(shape, 2, 1, 0, blocks), blocks, threads=1).run(None, {"x": x})[0]
    kernel, current = native.load(), x
    for name, (n, k) in floor.products.items():
        if name != "head":
            current = kernel.product(np.ascontiguousarray(current[:, :k]), floor.arrays[f"{name}.codes"],
                                     floor.arrays[f"{name}.scales"], n=n, k=k, bits=floor.bits, block_size=32)
    assert current[:, :expected.shape[1]].shape == expected.shape
    np.testing.assert_allclose(current[:, :expected.shape[1]], expected, rtol=0.05, atol=0.05 * np.abs(expected).max())


def test_real_shapes():
    """The looped checkpoints' layer shapes (every layer: the build streams weights), or fewer on request."""
    from speedc.bench.synthetic import SHAPES, layers_that_fit, shape_config

    ouro = SHAPES["ouro-1.4b"]
    cfg = shape_config(ouro, 2)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == \
        (2048, 16, 128, 5632, 49152)
    assert cfg.layer_map == [0, 1] * 4 and cfg.sandwich_norms and cfg.loop_norm and not cfg.final_norm
    assert layers_that_fit(ouro) == ouro.layers and layers_that_fit(ouro, 2) == 2
    # Ouro-1.4B's parameter count from these shapes, gate excluded (the checkpoint holds 1,434,652,673 with it)
    assert ouro.layers * ouro.block_params() + ouro.fixed_params() - 2048 == 1_434_652_673 - 2049
    # --end-to-end: the zoo family untied (tied, small residual updates predict the token just read)
    from speedc.bench.synthetic import end_to_end_shape, zoo_shape

    assert end_to_end_shape(ouro) is ouro and zoo_shape(1024).tied and not end_to_end_shape(zoo_shape(1024)).tied


def test_memory_bound_on_a_looped_shape():
    """The synthetic path on a (tiny) looped shape with sandwich norms and loop norms, written in Ouro's
    published layout and built like a real checkpoint; --end-to-end adds SPEED vs plain decoding per
    depth at the acceptance measured (ids checked identical inside: a mismatch raises)."""
    from speedc.bench.synthetic import Shape, synthetic_step_costs

    tiny = Shape("ouro-tiny", 64, 4, 4, 16, 96, 128, 2, 4, looped=True, sandwich_norms=True)
    report = synthetic_step_costs(shape=tiny, context=64, repeats=5, end_to_end=True, new_tokens=12, prompts=2, peers=False,
                                  exit_rules=[{"exit_threshold": 0.5}, {"exit_at_step": 0}])
    assert report["passes"] == 4 and [row["slots"] for row in report["rows"]] == [2, 4]
    threshold, first = report["rows"][-1]["exit_rules"]  # at P = loops only (one loop a slot)
    assert "exit_rules" not in report["rows"][0]
    assert threshold["rule"] == "4 loops, exit threshold 0.5" and first["exit_loops"] == {0: 2 * 12}
    assert sum(threshold["exit_loops"].values()) == 2 * 12 and all(row["ids_identical"] for row in (threshold, first))
    assert first["acceptance"] == 0 and first["speedup_decode"] > 0 and first["vs_plain_full_depth"] > 0
    assert all(row["step_cost"] > 0 for row in report["rows"]) and report["note"] == ""
    assert report["residual_scale"] == round(0.025 / 6 ** 0.5, 5) and report["label"].startswith("SPEED vs plain decoding")
    for row in report["rows"]:
        assert row["ids_identical"] and 0 <= row["acceptance"] <= 1 and row["speedup_decode"] > 0
    summary = report["end_to_end"]  # the deepest pipeline, as other tools read it
    assert summary["slots"] == 4 and summary["identical_ids"] and summary["speedup"] == report["rows"][-1]["speedup_decode"]
    assert summary["acceptance_rate"] == report["rows"][-1]["acceptance"] and summary["peers"] == {}


def test_memory_bound_on_a_recurrent_shape():
    """Huginn's recurrent depth (tiny): its published layout written and built like a real checkpoint,
    every depth P dividing R measured, the floor passing R / P times over the core per step; ids
    checked identical inside (a mismatch raises); llama.cpp named as missing (no such architecture)."""
    from speedc.bench.synthetic import SHAPES, Shape, pipeline_depths, synthetic_step_costs

    tiny = Shape("huginn-tiny", 64, 4, 4, 16, 96, 128, 2, 4, looped=False, tied=True, prelude=1, coda=1, recurrent=True)
    assert pipeline_depths(tiny, 2) == [2, 4] and pipeline_depths(SHAPES["huginn-3.5b"], 4) == [2, 4, 8]
    report = synthetic_step_costs(shape=tiny, context=64, repeats=5, end_to_end=True, new_tokens=10, prompts=2,
                                  exit_rules=[{"loops": 2}])
    assert report["passes"] == 4 and [row["slots"] for row in report["rows"]] == [2, 4]
    assert report["residual_scale"] == round(0.0085 / 6 ** 0.5, 5)
    (loops,) = report["rows"][-1]["exit_rules"]  # at the deepest pipeline only
    assert "exit_rules" not in report["rows"][0] and loops["rule"] == "2 loops, last loop"
    assert loops["exit_loops"] == {1: 2 * 10} and loops["ids_identical"] and loops["speedup_decode"] > 0
    for row in report["rows"]:
        assert row["ids_identical"] and 0 <= row["acceptance"] <= 1 and row["floor_step_cost"] > 0
    assert report["end_to_end"]["peers_missing"] == {"llama.cpp": "no Huginn (RavenForCausalLM) architecture in llama.cpp"}
    huginn = SHAPES["huginn-3.5b"]  # the published shape: 3.5 B parameters with the embedding stored once
    params = (huginn.prelude + huginn.layers + huginn.coda) * huginn.block_params() + huginn.fixed_params() + 2 * huginn.hidden ** 2
    assert 3.4e9 < params < 3.7e9


def test_recurrence_goes_with_a_recurrent_shape():
    assert_one_line_error(run_cli("bench", "memory-bound", "--recurrence", "8"), "--recurrence goes with a recurrent-depth shape")


def test_memory_bound_peers_say_what_is_missing(monkeypatch, tmp_path):
    """Without llama-cpp-python the end-to-end report names the install in one line (asked for explicitly:
    a one-line refusal); the zoo shape has no llama.cpp peer."""
    import speedc.bench.peers as peers
    from speedc.bench.synthetic import SHAPES, memory_bound_peers, zoo_shape
    from speedc.errors import SpeedcError

    monkeypatch.setattr(peers, "llama_cpp_installed", lambda: False)
    args = (tmp_path, tmp_path, "int4", 1, 8)
    assert memory_bound_peers(SHAPES["ouro-1.4b"], *args, None, print) == ({}, {"llama.cpp": peers.LLAMA_CPP_INSTALL})
    assert memory_bound_peers(SHAPES["ouro-1.4b"], *args, False, print) == ({}, {})
    with pytest.raises(SpeedcError, match="llama.cpp peer needs llama-cpp-python: pip install 'speedc.peers.'"):
        memory_bound_peers(SHAPES["nanbeige-3b"], *args, True, print)
    assert memory_bound_peers(zoo_shape(256), *args, None, print) == ({}, {})
    with pytest.raises(SpeedcError, match="runs the looped shapes"):
        memory_bound_peers(zoo_shape(256), *args, True, print)


@pytest.mark.parametrize("args, message", [
    (["--peer", "transformers"], "--peer does not go with `speedc bench memory-bound`: it goes with `speedc bench artifact`"),
    (["--peers"], "--peers goes with --end-to-end"),
    (["--new-tokens", "8"], "--new-tokens goes with --end-to-end"),
    (["--exit-threshold", "0.5"], "--exit-threshold goes with --end-to-end"),
    (["--end-to-end", "--exit-at-step", "0"], "--exit-threshold / --exit-at-step go with an Ouro shape"),
    (["--end-to-end", "--loops", "2"], "--loops goes with an Ouro or recurrent shape"),
    (["--shape", "ouro-1.4b", "--hidden", "64"], "--hidden sizes the zoo shape; ouro-1.4b has its own"),
    (["--no-such-option"], "`speedc bench memory-bound` has no option --no-such-option"),
])
def test_memory_bound_refuses_peer_options_it_cannot_use(args, message):
    assert_one_line_error(run_cli("bench", "memory-bound", *args), message)


@pytest.mark.parametrize("args, message", [
    (["--sweep", "length"], "--sweep does not go with `speedc bench concurrency`: it goes with `speedc bench artifact`"),
    (["--backend", "torch"], "--backend does not go with `speedc bench concurrency`: it goes with "
                             "`speedc bench artifact` and `speedc bench memory-bound`"),
    (["--no-early-flush"], "--no-early-flush does not go with `speedc bench concurrency`"),
    (["--profile"], "--profile does not go with `speedc bench concurrency`: it goes with `speedc bench memory-bound`"),
    (["--clients", "99999999999999999999"], "at most 1024 clients"),  # was a numpy traceback
    (["--clients", "1,x"], "--clients must be comma-separated integers"),
])
def test_concurrency_bench_refuses_options_it_would_ignore(tiny_artifact, args, message):
    """Before: these ran the concurrency table and silently dropped the option."""
    assert_one_line_error(run_cli("bench", "concurrency", tiny_artifact, "--clients", "1,2", *args), message)


@pytest.mark.parametrize("args", [["ART"], ["ART", "--concurrency", "1,2"], ["--memory-bound"]])
def test_bench_names_its_three_benchmarks(tiny_artifact, args):
    """`speedc bench` without a benchmark named first: one line naming the three, not a usage block."""
    result = run_cli("bench", *(str(tiny_artifact) if a == "ART" else a for a in args))
    assert_one_line_error(result, "speedc bench runs one of: artifact, memory-bound, concurrency")


def test_concurrency_bench_rows_for_every_system(tiny_artifact):
    """`speedc bench concurrency` (no peers): a row per (clients, system), the unbatched engine at one
    client; every system's ids were required equal to plain decoding alone before any rate is reported."""
    result = run_cli("bench", "concurrency", tiny_artifact, "--clients", "1,2", "--new-tokens", "8", "--repeats", "2",
                     "--no-peers", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["identical_ids"] is True and report["repeats"] == 2
    rows = {(row["clients"], row["system"]): row for row in report["concurrency"]}
    batched = ("speed-adaptive", "speed-always", "plain-batched")
    assert set(rows) == {(1, name) for name in (*batched, "speed-unbatched")} | {(2, name) for name in batched}
    for (clients, system), row in rows.items():
        assert row["tokens_per_second"] > 0 and row["ms_per_token_p50"] <= row["ms_per_token_p99"]
        assert (row["scaling"] == 1.0) if clients == 1 else (row["scaling"] is None) == (system == "speed-unbatched")
        if system == "plain-batched":
            assert row["steps"]["speed"] == 0 and row["steps"]["plain"] > 0
        elif system == "speed-always":
            assert row["steps"]["plain"] == 0 and row["steps"]["speed"] > 0


def test_step_cost_is_measured_at_valid_positions_for_a_short_bench(tiny_artifact):
    """A bench of prompt + new tokens under 2(P-1) measured c(P) at negative positions: ONNX Runtime's
    attention refused them (a traceback after every run) and the other backends measured nonsense."""
    from speedc.step_timer import measure_step_cost
    from speedc.runtimes.engine import Engine

    for backend in ("onnx", "onnx-numpy"):
        engine = Engine.load(tiny_artifact, backend=backend)
        cost = measure_step_cost(engine, context=3, repeats=3)
        assert 0 < cost < 100, (backend, cost)


# A peer's process as process_peer runs one: reads {"prompt", "new_tokens"} lines, answers {"ids", "seconds"};
# this one answers its first prompt, then does what argv[1] says on the next.
SCRIPTED_PEER = """
import json, os, signal, sys, time
then = sys.argv[1]
for turn, line in enumerate(sys.stdin):
    ask = json.loads(line)
    if turn == 1 and then == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if turn == 1 and then == "hang":
        time.sleep(600)
    if turn == 1 and then == "garbage":
        print("llama_model_load: error", flush=True)
    if turn == 1 and then == "exit":
        print("llama.cpp: out of memory", file=sys.stderr)
        sys.exit(3)
    print(json.dumps({"ids": ask["prompt"][:ask["new_tokens"]], "seconds": 0.001}), flush=True)
"""


@pytest.mark.parametrize("then, why", [("segfault", "crashed (SIGSEGV)"), ("hang", "hung: no answer in 2 s"),
                                       ("garbage", "answered 'llama_model_load: error'"),
                                       ("exit", "exited with status 3: llama.cpp: out of memory")])
def test_a_peer_that_crashes_or_hangs_fails_in_its_own_process(then, why):
    """process_peer: a peer's crash, hang or nonsense raises PeerFailed saying which, and its process ends;
    the bench's process goes on."""
    from speedc.bench.peers import PeerFailed, process_peer

    generate = process_peer(SCRIPTED_PEER, [then], answer_seconds=2)
    assert generate([4, 5, 6], 2) == ([4, 5], 0.001)
    with pytest.raises(PeerFailed) as failed:
        generate([7, 8, 9], 2)
    assert str(failed.value) == why
    with pytest.raises(PeerFailed):
        generate([7, 8, 9], 2)  # never answers again once ended
    generate.close()


def test_a_failed_peer_gets_a_row_that_says_so_and_the_bench_goes_on(tiny_artifact):
    """end_to_end_row: the peer that crashed on the second prompt is asked no more, its row says why; SPEED's
    rows and the peer that kept answering are whole."""
    from speedc.bench.peers import process_peer
    from speedc.bench.synthetic import end_to_end_row
    from speedc.runtimes.engine import Engine

    engine = Engine.load(tiny_artifact)
    crashing, steady = process_peer(SCRIPTED_PEER, ["segfault"]), process_peer(SCRIPTED_PEER, ["answer"])
    try:
        row = end_to_end_row(engine, prompts=3, new_tokens=6, peers={"crashing": (crashing, "a scripted peer"),
                                                                     "steady": (steady, "a scripted peer")})
    finally:
        crashing.close()
        steady.close()
    assert row["ids_identical"] and row["speedup_decode"] > 0
    assert row["peers"]["crashing"] == {"failed": "crashed (SIGSEGV) on prompt 2 of 3", "ran": "a scripted peer"}
    assert row["peers"]["steady"]["ms_per_token"] == 1.0 and "failed" not in row["peers"]["steady"]


def test_interleaved_medians_stop_at_their_time_budget_after_the_fewest_rounds():
    """A budget of SECONDS ends the timed rounds early (a real-size model's rounds take most of a second),
    but never before MIN_ROUNDS; without one every round runs."""
    import time

    from speedc.step_timer import MIN_ROUNDS, interleaved_medians

    calls = {"a": 0, "b": 0}

    def run(name, pause):
        def go():
            calls[name] += 1
            time.sleep(pause)
        return go

    interleaved_medians(run("a", 0.002), run("b", 0.001), repeats=200, warmup=2, seconds=0.0)
    assert calls == {"a": 2 + MIN_ROUNDS, "b": 2 + MIN_ROUNDS}
    calls.update(a=0, b=0)
    interleaved_medians(run("a", 0.0), run("b", 0.0), repeats=30, warmup=1)
    assert calls == {"a": 31, "b": 31}
