"""Model configuration: Hugging Face LlamaConfig fields plus a `speedc` section, and the block and
loop description every consumer (reference model, trace pass, PyTorch backend) reads.

Which checkpoint families can be read, and how their config.json maps onto this, is the family
registry's business (models/families/__init__.py: read_config, load_config).

config.json example (the speedc section is what a plain Llama config lacks):

    {"model_type": "llama", "hidden_size": 384, "num_hidden_layers": 16, ...,
     "speedc": {"format_version": 1,
                "layer_map": {"pattern": "cycle", "num_blocks": 4},
                "exit": {"layer": 4, "norm": "own"}}}

`exit.layer` is the number of logical layers the early-exit head reads after (4 = after layers
0..3); `exit.norm` is "own" (a separate RMSNorm weight), "final" (reuse the final norm) or "none"
(the state is already normed: a looped model's loop-boundary norm). A `speedc.block` section carries
what a family's block and loop do: `sandwich_norms` (each sublayer's output is RMS-normed before the
residual add: input_layernorm_2 / post_attention_layernorm_2), `post_norms` (with sandwich norms: each second norm takes the residual sum, Huginn's order), `qk_bias`
(q_bias / k_bias added to q and k before rotary), `embed_scale` (the embedding's multiplier), `qk_norm`
(a weightless RMS norm over each head's q and k after rotary), `mlp_act` ("silu-gated": down(silu(gate) * up);
"relu2": down(0.5 * relu(up)^2), no gate), `value_embed_blocks` (blocks whose attention adds a gated
embedding of the row's token to v, Parcae's value embeddings). A `speedc.depth` section (speedc/format/depth_plan.py,
written by speedc) carries the token's trip through the blocks: prelude / core x repeats / coda and the loop
norms, `loop_norm` (model.norm replaces the state after every core repeat) and `final_norm` (the final head
applies model.norm); without it the plan is derived from the layer map and `speedc.block`'s `loop_norm` /
`final_norm` (configs written before the plan held them).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from speedc.errors import CheckpointError
from speedc.format.depth_plan import DepthPlan, fit_plan, with_repeats
from speedc.models.layer_map import describe_layer_map, resolve_layer_map

CONFIG_FORMAT_VERSION = 1
MLP_ACTS = ("silu-gated", "relu2")
VALUE_GATE_CHANNELS = 32  # the value-embedding gate reads the first 32 channels of the normed input (Parcae)
MAX_CONTEXT = 1 << 22  # positions: 4 M (a 1e9-position config took 122 s to build an artifact that could not run)


@dataclasses.dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    # The phases of a token's trip (speedc/format/depth_plan.py): the one form of the layer map, the number of
    # logical layers and where model.norm sits (from_layer_map fits or derives it from a bare map).
    depth_plan: DepthPlan
    exit_layer: int
    exit_norm: str = "own"  # "own" | "final" | "none"
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()  # every end-of-text id, eos_token_id first (() : just eos_token_id)
    architecture: str = "llama"  # the family (models/families/__init__.py) the checkpoint was read as
    sandwich_norms: bool = False  # Ouro: h = x + norm2(attn(norm1(x))); out = h + norm4(mlp(norm3(h)))
    post_norms: bool = False  # with sandwich_norms, Huginn's order: h = norm2(x + attn(norm1(x))); out = norm4(h + mlp(norm3(h)))
    qk_bias: bool = False  # a bias added to q and k before rotary (Huginn's qk_bias)
    embed_scale: float = 1.0  # the embedding is multiplied by this on entry (Huginn: sqrt(hidden_size))
    qk_norm: bool = False  # q and k RMS-normed per head (no weight) after rotary (Parcae)
    mlp_act: str = "silu-gated"  # MLP_ACTS: "relu2" is Parcae's non-gated 0.5 * relu(up x)^2
    # Blocks whose attention adds 2 sigmoid(value_gate(xn[:32])) * value_embed[token] to v, per kv head (Parcae).
    value_embed_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.eos_token_ids or self.eos_token_ids[0] != self.eos_token_id:  # eos_token_id was set on its own
            self.eos_token_ids = (self.eos_token_id,)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.value_embed_blocks = tuple(self.value_embed_blocks)
        if not isinstance(self.depth_plan, DepthPlan):
            raise CheckpointError(f"internal: a model's depth plan must be a DepthPlan, not {type(self.depth_plan).__name__}")
        self.validate()

    @classmethod
    def from_layer_map(cls, layer_map: list[int], *, loop_norm: bool = False, final_norm: bool = True,
                       declared: DepthPlan | None = None, **fields) -> "ModelConfig":
        """A config over LAYER_MAP: the DECLARED plan relabelled to it where it fits (a family's loops, where its
        norms sit), else the plan derived from the map (its most repeats); LOOP_NORM / FINAL_NORM: the norms."""
        return cls(depth_plan=fit_plan(list(layer_map), declared, loop_norm, final_norm), **fields)

    def with_layer_map(self, layer_map: list[int]) -> "ModelConfig":
        """This model over LAYER_MAP (the blocks the share pass found): its plan fitted to the new map."""
        return dataclasses.replace(self, depth_plan=fit_plan(list(layer_map), self.depth_plan, self.loop_norm,
                                                             self.final_norm))

    # ---- derived ------------------------------------------------------------------------
    @property
    def layer_map(self) -> list[int]:
        """Logical layer -> the block it runs: the plan's prelude, core x repeats, coda."""
        return self.depth_plan.layer_map

    @property
    def num_hidden_layers(self) -> int:
        return self.depth_plan.num_layers

    @property
    def loop_norm(self) -> bool:
        """Looped models: state = model.norm(state) after every pass over the core."""
        return self.depth_plan.loop_norm

    @property
    def final_norm(self) -> bool:
        """The final head normalizes (False: the last loop-boundary norm already did)."""
        return self.depth_plan.final_norm

    @property
    def num_blocks(self) -> int:
        return max(self.layer_map) + 1

    @property
    def carries_token_id(self) -> bool:
        """Whether a slot carries its token's id (as one float) beside its vectors: a core or coda block
        adds value embeddings of the token, which a slot behind slot 0 no longer has as input_ids."""
        plan = self.depth_plan
        return any(block in self.value_embed_blocks for block in (*plan.core, *plan.coda))

    @property
    def state_width(self) -> int:
        """Floats a pipeline slot carries per token between steps: the state, and e with an injection, and
        the token's id where later blocks read value embeddings ([state | e | id])."""
        return self.hidden_size * self.depth_plan.carried_vectors + int(self.carries_token_id)

    def with_recurrence(self, repeats: int) -> "ModelConfig":
        """This model with its recurrent core run REPEATS times (the draft tap and every weight unchanged)."""
        plan = self.depth_plan
        if not plan.injection:  # a loop count of Ouro / Nanbeige is what it was trained at: only recurrent depth varies
            raise CheckpointError(f"--recurrence: this {self.architecture} model's depth ({plan.describe()}) is not a "
                                  "recurrent core with an injection (Huginn); its loop count is fixed")
        plan = with_repeats(plan, repeats)
        if self.exit_layer > plan.num_layers - len(plan.coda):
            raise CheckpointError(f"--recurrence {repeats}: the draft tap after layer {self.exit_layer} lies past the core")
        return dataclasses.replace(self, depth_plan=plan)

    def with_state_init(self, kind: str, seed: int = 0) -> "ModelConfig":
        """This model with its recurrent core started from KIND ("zero", or "random" under SEED)."""
        plan = self.depth_plan
        if not plan.injection:
            raise CheckpointError(f"--state-init: this {self.architecture} model's depth ({plan.describe()}) has no "
                                  "recurrent core with an injection (Huginn) whose start state could be chosen")
        return dataclasses.replace(self, depth_plan=dataclasses.replace(plan, state_init=kind, state_seed=seed))

    def validate(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise CheckpointError(f"config.json: {message}")

        for name in ("vocab_size", "hidden_size", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
             f"head_dim must be a positive even integer (rotary embedding), got {self.head_dim!r}")
        for name, value in (("bos_token_id", self.bos_token_id), *(("eos_token_id", v) for v in self.eos_token_ids)):
            need(isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.vocab_size,
                 f"{name} {value!r} (here or in generation_config.json) is outside the vocabulary (0..{self.vocab_size - 1})")
        need(0 < self.rms_norm_eps < math.inf, f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}")
        need(0 < self.rope_theta < math.inf, f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        need(self.max_position_embeddings <= MAX_CONTEXT,  # the graphs hold [context, head_dim / 2] rotary tables
             f"max_position_embeddings {self.max_position_embeddings:,} is beyond what this build supports ({MAX_CONTEXT:,})")
        need(not self.post_norms or self.sandwich_norms, "speedc.block.post_norms needs sandwich_norms (its second norms)")
        need(0 < self.embed_scale < math.inf, f"speedc.block.embed_scale must be a finite number > 0, got {self.embed_scale!r}")
        need(self.mlp_act in MLP_ACTS, f"speedc.block.mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        need(all(isinstance(b, int) and 0 <= b < self.num_blocks for b in self.value_embed_blocks),
             f"speedc.block.value_embed_blocks must name blocks 0..{self.num_blocks - 1}, got {list(self.value_embed_blocks)}")
        need(not self.value_embed_blocks or self.hidden_size >= VALUE_GATE_CHANNELS,
             f"value embeddings' gate reads {VALUE_GATE_CHANNELS} channels; hidden_size is {self.hidden_size}")
        need(self.exit_norm in ("own", "final", "none"),
             f"speedc.exit.norm must be 'own', 'final' or 'none', got {self.exit_norm!r}")
        need(1 <= self.exit_layer <= self.num_hidden_layers,
             f"speedc.exit.layer must be in 1..{self.num_hidden_layers}, got {self.exit_layer}")
        resolve_layer_map(self.layer_map, self.num_hidden_layers)

    def describe(self) -> str:
        return (f"N={self.num_hidden_layers} layers over {describe_layer_map(self.layer_map)}, "
                f"hidden {self.hidden_size}, heads {self.num_attention_heads}/{self.num_key_value_heads} kv, "
                f"vocab {self.vocab_size}, exit after layer {self.exit_layer}")

    # ---- (de)serialisation --------------------------------------------------------------
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id,
            "torch_dtype": "float32",
            "speedc": {
                "format_version": CONFIG_FORMAT_VERSION,
                "exit": {"layer": self.exit_layer, "norm": self.exit_norm},
                "block": {"architecture": self.architecture, "sandwich_norms": self.sandwich_norms,
                          "post_norms": self.post_norms, "qk_bias": self.qk_bias, "embed_scale": self.embed_scale,
                          "qk_norm": self.qk_norm, "mlp_act": self.mlp_act,
                          "value_embed_blocks": list(self.value_embed_blocks)},
                "depth": self.depth_plan.to_json(),  # the layer map and the loop norms live here only
            },
        }

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
