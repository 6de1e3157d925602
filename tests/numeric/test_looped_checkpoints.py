"""Looped checkpoints in their published layouts (Ouro, Nanbeige4.2): speedc against independent oracles.

The checkpoints are tiny and random (tests/looped_checkpoints.py) but have the real file layout, tensor
names, config keys and token-id files. The oracles are assembled here from transformers' Llama parts,
following the published forward passes (/work/shared_notes/looped_spec.md):

    Nanbeige: LlamaForCausalLM with the checkpoint's L layers (its tensor names are Llama's), run once
              per loop on the full sequence; LlamaModel ends every call with model.norm, which is the
              loop-boundary norm. skip_loop_final_norm: no norm between loops, one at the end.
    Ouro:     LlamaAttention / LlamaMLP / LlamaRMSNorm / LlamaRotaryEmbedding wired as the sandwich
              block (four norms per layer), model.norm after every loop, lm_head on the last loop's
              normed state (no further norm); loaded with strict=True from the published names.

Checked: the PyTorch reference's logits (final and draft = loop-1 head) against the oracle in fp32
(atol/rtol 1e-4); the built artifact's schedule (P = loops, exit after one loop); greedy ids of SPEED
== plain decoding == the oracle's greedy continuation, and seeded sampling SPEED == plain, on every
backend; both a residual-scaled model (speculation accepted) and a perturbed one (mispredictions), with
a guard that both outcomes really occur. Then token ids (generation_config.json wins over config.json,
--eos-token-id wins over both, inspect says where each came from) and bad input (one-line errors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from conftest import assert_one_line_error, run_cli
from looped_checkpoints import (INDEX, NANBEIGE_SHARDS, OURO_CONFIG_EOS, OURO_GENERATION_EOS, nanbeige_token_ids,
                                perturb, read_tensors, rewrite_tensors, write_nanbeige, write_ouro,
                                write_sparse_safetensors)
from speedc.format.artifact import read_manifest
from speedc.build import build
from speedc.errors import CheckpointError
from speedc.models.checkpoint.torch_io import load_checkpoint, load_model
from speedc.passes.base import BuildOptions
from speedc.runtimes.engine import Engine

ATOL, RTOL = 1e-4, 1e-4  # fp32, two implementations summing in different orders
VOCAB, HIDDEN = 128, 64
SCALED = 0.05  # residual scale: the loop-1 draft agrees with the last loop often (measured ~0.6 / ~0.8)
PERTURB = 20.0  # perturb() factor: back to full-size residual branches, the draft is mostly wrong
PROMPT_LEN, NEW_TOKENS = 6, 24
PROMPT_SEEDS = (0, 1, 2)
SAMPLING_SEEDS = (11, 12)
BACKENDS = ("onnx", "onnx-numpy", "torch")


@dataclass(frozen=True)
class Variant:
    family: str  # "ouro" | "nanbeige"
    layers: int
    loops: int
    seed: int
    perturbed: bool = False  # written residual-scaled, then perturb()ed: speculation mostly fails
    skip_loop_final_norm: bool = False  # Nanbeige only

    def write(self, directory: Path) -> Path:
        common = dict(layers=self.layers, loops=self.loops, seed=self.seed, residual_scale=SCALED)
        if self.family == "ouro":
            path = write_ouro(directory, **common)
        else:
            path = write_nanbeige(directory, skip_loop_final_norm=self.skip_loop_final_norm, **common)
        return perturb(path, factor=PERTURB) if self.perturbed else path


# The published shapes' structure at tiny sizes. The compiler's time grows with layers x loops, so only
# Nanbeige's scaled model has the default 3 layers (a middle layer that neither starts nor ends a loop);
# the others vary the shape and the loop count (P = 4, 3, 2).
VARIANTS = {
    "ouro-scaled": Variant("ouro", layers=2, loops=4, seed=1),
    "ouro-perturbed": Variant("ouro", layers=1, loops=3, seed=1, perturbed=True),
    "nanbeige-scaled": Variant("nanbeige", layers=3, loops=2, seed=2),
    "nanbeige-perturbed": Variant("nanbeige", layers=2, loops=2, seed=2, perturbed=True),
    "nanbeige-skip-loop-norm": Variant("nanbeige", layers=2, loops=3, seed=3, skip_loop_final_norm=True),
}


# ---- oracles ---------------------------------------------------------------------------------------------
def llama_config(raw: dict, *, layers: int) -> LlamaConfig:
    """transformers' LlamaConfig with the checkpoint's dimensions (read here from config.json, not by speedc)."""
    config = LlamaConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=layers, num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"], rms_norm_eps=raw["rms_norm_eps"],
        max_position_embeddings=raw["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(raw["rope_theta"])},
        attention_bias=False, mlp_bias=False, hidden_act="silu", tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return config


class NanbeigeOracle(nn.Module):
    """transformers' LlamaForCausalLM (L layers) run num_loops times (published NanbeigeModel.forward)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        raw = json.loads((directory / "config.json").read_text())
        self.loops, self.skip = raw["num_loops"], raw["skip_loop_final_norm"]
        self.llama = LlamaForCausalLM(llama_config(raw, layers=raw["num_hidden_layers"]))
        self.llama.load_state_dict(read_tensors(directory), strict=True)
        self.llama.eval()

    @torch.no_grad()
    def loop_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """The state after each loop as a head reads it (through model.norm; without skip_loop_final_norm
        that normed state is also what the next loop reads)."""
        model = self.llama.model
        norm = model.norm
        if self.skip:
            model.norm = nn.Identity()  # no norm between loops
        try:
            h, states = model.embed_tokens(ids), []
            for _ in range(self.loops):
                h = model(inputs_embeds=h, use_cache=False).last_hidden_state  # ends with model.norm (loop boundary)
                states.append(h)
        finally:
            model.norm = norm
        return [norm(s) for s in states] if self.skip else states

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.llama.lm_head(self.loop_states(ids)[-1])


class OuroLayer(nn.Module):
    """Ouro's sandwich block (spec 1.4):
        h = x + input_layernorm_2(attn(input_layernorm(x)))
        out = h + post_attention_layernorm_2(mlp(post_attention_layernorm(h)))"""

    def __init__(self, config: LlamaConfig, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index)
        self.mlp = LlamaMLP(config)
        for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            setattr(self, name, LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, x, position_embeddings, mask):
        attended, _ = self.self_attn(self.input_layernorm(x), position_embeddings, mask)
        x = x + self.input_layernorm_2(attended)
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroOracle(nn.Module):
    """The published OuroModel.forward at the default readout (the last loop; the gate is never needed
    with early_exit_threshold 1.0 in fp32), full-sequence causal attention."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        raw = json.loads((directory / "config.json").read_text())
        config = llama_config(raw, layers=raw["num_hidden_layers"])
        self.loops = raw["total_ut_steps"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(OuroLayer(config, i) for i in range(config.num_hidden_layers))
        self.model.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.model.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)  # inv_freq is not persistent: not in the state dict
        self.load_state_dict(read_tensors(directory), strict=True)  # exactly the published names
        self.eval()

    @torch.no_grad()
    def loop_states(self, ids: torch.Tensor) -> list[torch.Tensor]:
        length = ids.shape[1]
        h = self.model.embed_tokens(ids)
        positions = torch.arange(length)[None]
        position_embeddings = self.rotary(h, positions)
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # additive, causal
        states = []
        for _ in range(self.loops):
            for layer in self.model.layers:
                h = layer(h, position_embeddings, mask)
            h = self.model.norm(h)  # every loop, the last included
            states.append(h)
        return states

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.loop_states(ids)[-1])


def oracle_greedy(oracle: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Recompute the whole sequence for every token (no cache: nothing shared with any decode path)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(oracle(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def prompt(seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- shared, lazily built checkpoints, artifacts, oracles and engines -------------------------------------
class Looped:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def checkpoint(self, variant: str) -> Path:
        return self._get(("checkpoint", variant), lambda: VARIANTS[variant].write(self.root / variant))

    def artifact(self, variant: str) -> Path:
        out = self.root / f"{variant}.art"
        return self._get(("artifact", variant), lambda: build(self.checkpoint(variant), out, BuildOptions()).out)

    def oracle(self, variant: str) -> nn.Module:
        make = OuroOracle if VARIANTS[variant].family == "ouro" else NanbeigeOracle
        return self._get(("oracle", variant), lambda: make(self.checkpoint(variant)))

    def greedy(self, variant: str, seed: int) -> list[int]:
        return self._get(("greedy", variant, seed),
                         lambda: oracle_greedy(self.oracle(variant), prompt(seed), NEW_TOKENS))

    def engine(self, variant: str, backend: str) -> Engine:
        return self._get(("engine", variant, backend), lambda: Engine.load(self.artifact(variant), backend=backend))


@pytest.fixture(scope="module")
def looped(tmp_path_factory) -> Looped:
    return Looped(tmp_path_factory.mktemp("looped"))


# ---- the reference model against the oracles -------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_matches_oracle(looped, variant):
    directory = looped.checkpoint(variant)
    model = load_model(directory)
    oracle = looped.oracle(variant)
    assert model.cfg.architecture == VARIANTS[variant].family
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ours = model(ids, with_exit=True)
    states = oracle.loop_states(ids)
    head = oracle.lm_head if isinstance(oracle, OuroOracle) else oracle.llama.lm_head
    torch.testing.assert_close(ours.logits, head(states[-1]), atol=ATOL, rtol=RTOL)
    # The draft head: lm_head of the state after loop 1 (normed at the loop boundary).
    torch.testing.assert_close(ours.exit_logits, head(states[0]), atol=ATOL, rtol=RTOL)
    # Far from uniform: the comparison above is not between near-constant logits.
    assert (ours.logits.max(-1).values - ours.logits.min(-1).values).min() > 1.0


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_default_shapes_match_oracle(tmp_path, family):
    """The writers' default shapes (3 layers, unscaled residuals) as the reference reads them."""
    directory = (write_ouro if family == "ouro" else write_nanbeige)(tmp_path / family)
    oracle = (OuroOracle if family == "ouro" else NanbeigeOracle)(directory)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(load_model(directory)(ids).logits, oracle(ids), atol=ATOL, rtol=RTOL)


# ---- the artifact ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_artifact_pipelines_one_loop_per_slot(looped, variant):
    spec = VARIANTS[variant]
    manifest = read_manifest(looped.artifact(variant))
    assert manifest.slots == spec.loops  # P = loops: slot s runs loop s
    assert manifest.exit_layer == spec.layers  # the draft reads the state after one loop
    assert manifest.layer_map == [layer % spec.layers for layer in range(spec.layers * spec.loops)]
    assert manifest.model["num_unique_blocks"] == spec.layers
    assert manifest.model["architecture"] == spec.family


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_speed_equals_plain_equals_oracle(looped, variant, backend):
    engine = looped.engine(variant, backend)
    for seed in PROMPT_SEEDS:
        expected = looped.greedy(variant, seed)
        speed = engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode="speed-always", stop_at_eos=False)
        plain = engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode="autoregressive", stop_at_eos=False)
        assert plain.ids == expected, f"prompt seed {seed}: plain decoding differs from the oracle"
        assert speed.ids == expected, f"prompt seed {seed}: SPEED differs from the oracle ({speed.stats})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_seeded_sampling_speed_equals_plain(looped, variant, backend):
    engine = looped.engine(variant, backend)
    for seed in SAMPLING_SEEDS:
        runs = [engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode=mode, temperature=0.8, top_p=0.9,
                                seed=seed, stop_at_eos=False) for mode in ("speed-always", "autoregressive")]
        assert runs[0].ids == runs[1].ids, f"sampling seed {seed}"
        assert len(runs[0].ids) == NEW_TOKENS


def test_speculation_is_both_accepted_and_flushed(looped):
    """The lossless checks above mean something only if SPEED both kept and threw away speculated work:
    on every model (the scaled ones mostly accept, the perturbed ones mostly flush) both must happen."""
    totals = {}
    for variant in VARIANTS:
        engine = looped.engine(variant, "onnx")
        accepted = failed = 0
        for seed in PROMPT_SEEDS:
            stats = engine.generate(prompt(seed), max_new_tokens=NEW_TOKENS, mode="speed-always", stop_at_eos=False).stats
            accepted += stats.accepted
            failed += stats.mispredicted + stats.early_flushes
        totals[variant] = (accepted, failed)
    assert all(accepted > 0 and failed > 0 for accepted, failed in totals.values()), totals
    # The perturbation does what it is for: more failed speculations than on the scaled model.
    for family in ("ouro", "nanbeige"):
        scaled, perturbed = totals[f"{family}-scaled"], totals[f"{family}-perturbed"]
        assert perturbed[1] / sum(perturbed) > scaled[1] / sum(scaled), totals


# ---- token ids ----------------------------------------------------------------------------------------------
def test_generation_config_token_ids_win(looped):
    ouro = read_manifest(looped.artifact("ouro-scaled")).model
    raw = json.loads((looped.checkpoint("ouro-scaled") / "config.json").read_text())
    assert raw["eos_token_id"] == OURO_CONFIG_EOS != OURO_GENERATION_EOS
    assert ouro["eos_token_id"] == OURO_GENERATION_EOS and ouro["bos_token_id"] == 0
    nanbeige = read_manifest(looped.artifact("nanbeige-scaled")).model
    assert (nanbeige["bos_token_id"], nanbeige["eos_token_id"]) == nanbeige_token_ids(VOCAB)


@pytest.fixture(scope="module")
def small_ouro(tmp_path_factory) -> Path:
    """One layer looped 4 times: the CLI checks below spend their time on the CLI, not the compiler."""
    return write_ouro(tmp_path_factory.mktemp("small-ouro") / "ckpt", layers=1, loops=4, seed=4)


def test_cli_eos_token_id_overrides(small_ouro, tmp_path):
    out = tmp_path / "out"
    result = run_cli("build", small_ouro, "-o", out, "--eos-token-id", "5", "--no-measure")
    assert result.returncode == 0, result.stderr
    manifest = read_manifest(out)
    assert manifest.model["eos_token_id"] == 5 and manifest.slots == 4


def test_inspect_ouro_checkpoint(small_ouro):
    result = run_cli("inspect", small_ouro, env={"COLUMNS": "400"})  # rich wraps at the terminal width
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for fragment in ("architecture ouro", "P=4", f"eos {OURO_GENERATION_EOS} (from generation_config.json)",
                     "bos 0 (from generation_config.json)", "1 layers looped total_ut_steps=4 times",
                     "early_exit_threshold=1.0", "not applied", "--eos-token-id",
                     "depth rules per request: loops 1..4, exit_at_step 0..3"):
        assert fragment in text, (fragment, result.stdout)


# ---- bad input: one line, exit 1, no artifact ------------------------------------------------------------
def _build_fails(checkpoint: Path, tmp_path: Path, *fragments: str) -> None:
    out = tmp_path / "out"
    result = run_cli("build", checkpoint, "-o", out, "--no-measure")
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert_one_line_error(result, *fragments)
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_unknown_architecture(tmp_path):
    directory = write_ouro(tmp_path / "ckpt", extra_config={"architectures": ["FooForCausalLM"]})
    _build_fails(directory, tmp_path, "unsupported architecture FooForCausalLM", "LlamaForCausalLM",
                 "NanbeigeForCausalLM", "OuroForCausalLM")


def test_missing_shard(tmp_path):
    directory = write_nanbeige(tmp_path / "ckpt")
    (directory / NANBEIGE_SHARDS[1]).unlink()
    _build_fails(directory, tmp_path, f"shard {NANBEIGE_SHARDS[1]} is missing", INDEX)


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    directory = write_nanbeige(tmp_path / "ckpt")
    _edit_json(directory / INDEX,
               lambda index: index["weight_map"].update({"model.layers.0.self_attn.q_proj.bias": NANBEIGE_SHARDS[0]}))
    _build_fails(directory, tmp_path, "model.layers.0.self_attn.q_proj.bias", NANBEIGE_SHARDS[0], "does not hold it")


def test_index_maps_a_tensor_to_the_wrong_shard(tmp_path):
    directory = write_nanbeige(tmp_path / "ckpt")
    _edit_json(directory / INDEX, lambda index: index["weight_map"].update({"lm_head.weight": NANBEIGE_SHARDS[0]}))
    with pytest.raises(CheckpointError, match=f"lm_head.weight in {NANBEIGE_SHARDS[0]}, which does not hold it"):
        load_checkpoint(directory)


def test_tensor_of_the_wrong_shape(tmp_path):
    directory = write_nanbeige(tmp_path / "ckpt")
    wrong = "model.layers.0.self_attn.q_proj.weight"
    rewrite_tensors(directory, lambda name, t: torch.zeros(HIDDEN, HIDDEN, dtype=t.dtype) if name == wrong else t)
    heads, head_dim = 4, 32  # write_nanbeige's defaults: q projects 64 -> 4 x 32 = 128
    _build_fails(directory, tmp_path, f"q_proj.weight has shape [{HIDDEN}, {HIDDEN}]",
                 f"config.json implies [{heads * head_dim}, {HIDDEN}]")


@pytest.mark.parametrize("family, option", [
    ("nanbeige", "enable_mhc"), ("nanbeige", "loop_share_kv"), ("nanbeige", "qk_layernorm"),
    ("ouro", "use_sliding_window"),
])
def test_unsupported_option(tmp_path, family, option):
    writer = write_ouro if family == "ouro" else write_nanbeige
    directory = writer(tmp_path / "ckpt", extra_config={option: True})
    _build_fails(directory, tmp_path, f"option {option}=True is not supported")


def test_checkpoint_larger_than_the_disk_is_refused_before_reading(tmp_path):
    directory = write_ouro(tmp_path / "ckpt", layers=1, loops=2)
    (directory / "model.safetensors").unlink()
    # One bf16 tensor of 2**44 - 2**20 bytes (ext4 caps a file at 16 TiB): a hole, no disk used.
    huge = write_sparse_safetensors(directory / "model.safetensors", "lm_head.weight", [2 ** 19, 2 ** 24 - 1])
    try:
        assert huge.stat().st_size > 2 ** 43 and huge.stat().st_blocks * 512 < 2 ** 20
        # The disk check reads only the header: loading the declared bytes would fail differently (or take hours).
        _build_fails(directory, tmp_path, "needs about", "GB (bf16 weights) but only", "GB are free")
    finally:
        huge.unlink()
