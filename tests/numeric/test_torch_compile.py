"""The PyTorch backend's step through torch.compile (`--backend torch --compile`, Engine.load(compile_step=True)):
the inductor CPU backend compiles the plain and the speed step without a graph break (fullgraph: a break
would be an error), once per step shape and cache bucket (the pool keeps its full length), and SPEED on the compiled step
equals plain decoding on it and the PyTorch reference, greedy and seeded, on a random model whose drafts
are mostly refused. The CUDA graph capture on top of it needs a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_one_line_error, build_artifact, random_config, randomize, run_cli
from speedc import Engine
from speedc.models.generate import generate as reference_generate
from speedc.models.llama import SharedLlama
from speedc.models.sampling import SamplingParams

PROMPT = [5, 9, 2, 14, 7]
NEW_TOKENS = 24
SAMPLING = {"greedy": {}, "seeded": dict(temperature=0.9, top_k=40, seed=11)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(the random model, its artifact, an engine whose step runs compiled), after one speed and one plain call
    (each step shape compiled once, ~20 s each on 2 cores)."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=31)
    art = build_artifact(model, tmp_path_factory.mktemp("torch-compile") / "art")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # counted from here: this module's compiles only
    engine = Engine.load(art, backend="torch", compile_step=True)
    return model, art, engine


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_speed_on_the_compiled_step_equals_plain_decoding_compile(compiled, sampling):
    model, _, engine = compiled
    settings = dict(max_new_tokens=NEW_TOKENS, stop_at_eos=False, **SAMPLING[sampling])
    speed = engine.generate(PROMPT, mode="speed-always", **settings)
    plain = engine.generate(PROMPT, mode="autoregressive", **settings)
    reference = reference_generate(model, PROMPT, NEW_TOKENS, SamplingParams(**SAMPLING[sampling]))
    assert speed.ids == plain.ids == reference
    assert speed.stats.mispredicted > 0 and speed.stats.speed_steps > 0  # it speculated, and was refused


def test_the_compiled_step_compiles_once_per_shape_without_graph_breaks_compile(compiled):
    """Four shapes: the plain step of one row and the speed step of P rows, each attending over a cache bucket of
    64 or 128 positions (the pool keeps its full length). Each is compiled once: other prompts, samplings and
    lengths reuse them (a compile per position, or per length of a growing pool, would count here)."""
    _, _, engine = compiled
    for mode in ("speed-always", "autoregressive"):
        engine.generate(PROMPT[:2], mode=mode, max_new_tokens=100, stop_at_eos=False)  # past the 64 of bucket one
    before = dict(torch._dynamo.utils.counters["stats"])
    for sampling in SAMPLING.values():
        for mode in ("speed-always", "autoregressive"):
            engine.generate(PROMPT, mode=mode, max_new_tokens=90, stop_at_eos=False, **sampling)
            engine.generate(PROMPT[:3], mode=mode, max_new_tokens=20, stop_at_eos=False, **sampling)
    assert dict(torch._dynamo.utils.counters["stats"]) == before  # nothing compiled again
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
    assert not torch._dynamo.utils.counters["graph_break"]


def test_compile_is_refused_by_name_off_the_torch_backend_compile(compiled):
    _, art, _ = compiled
    assert_one_line_error(run_cli("generate", art, "--prompt-ids", "1,2", "--compile"),
                          "--compile compiles the PyTorch backend's step", "use it with --backend torch")
