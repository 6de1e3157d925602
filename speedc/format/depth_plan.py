r"""Depth plans: the phases of one token's trip through a shared-weight decoder, and how the SPEED
pipeline spreads them over P slots.

    embed -> prelude (once) -> e ---> core repeat 0 -> [norm] -> core repeat 1 -> ... -> core repeat R-1 -> [norm]
                                 \__ injection (Huginn: every repeat reads adapter(cat[state, e]))    |
                                                  readout: [readout norm] -> coda -> [final norm] -> head

    Llama cycle  [0 1 2 3]*4         prelude ()   core (0 1 2 3) R=4  coda ()
    Ouro         L layers x loops    prelude ()   core (0..L-1)  R=loops, model.norm after each repeat
    Nanbeige     the same; model.norm after each repeat, or once at the end (skip_loop_final_norm)
    middle-cycle [0 1 2 1 2 1 2 3]   prelude (0)  core (1 2)     R=3      coda (3)
    Huginn       prelude (0 1), core (2 3 4 5) R=32 reading adapter(cat[state, e]) each repeat, the state
                 starting at zero; coda (6 7) behind model.norm (ln_f) at every readout, ln_f again at the head
    Parcae       prelude (0 1) then model.prelude_norm -> e; core (2 3) R=8, each repeat first
                 state = decay * state + dt * (e B^T) (diagonal-decay); the readout projection C on the
                 core's state at every readout, before the coda (4 5); model.norm at the head
    IQuest-Loop  core (0..L-1) R=2 with cross-repeat attention: repeat r >= 1's layer i attends
                 g * Attn(q, repeat 0's K/V of layer i, causal) + (1 - g) * Attn(q, its own K/V, last W positions),
                 g = sigmoid(<q_h, w_h> + b_h) per head (model.gate_projections.{i}); P = R, one repeat a slot

The pipeline (SlotPlan): P slots, each running K = R/P consecutive core repeats of one token; slot 0
also runs the prelude for the token entering it. The draft reads out inside slot 0 (after
`draft_layer` logical layers), the verified token after slot P-1, and an early-flush check reads a
deeper slot's state at the draft's tap. A readout's coda needs K/V of earlier positions at the same
depth, so each readout depth owns its coda K/V (speedc/format/cache_layout.py).

A family (models/families/*.py) emits its plan; a plan is also derived from a bare layer map (a Hugging
Face checkpoint whose sharing the compiler finds in the weights): the decomposition with the most core
repeats. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

from speedc.errors import CheckpointError
from speedc.format.cache_layout import CODA, CORE, PRELUDE, CacheLayout  # the phase names the artifact uses
# How a repeat reads the entry state e (None: it does not): "adapter-concat" state = adapter(cat[state, e])
# (Huginn); "diagonal-decay" state = decay * state + dt * (e B^T), decay = exp(-dt exp(A_log)), dt =
# softplus(dt_bias), per channel (Parcae).
INJECTIONS = (None, "adapter-concat", "diagonal-decay")
STATE_INITS = ("zero", "random")  # the core's start state (random: drawn per position, see DepthPlan)


@dataclass(frozen=True)
class LayerStep:
    """One logical layer of the trip: its block, where it sits, and what wraps it."""
    layer: int
    block: int
    phase: str
    repeat: int  # core repeat (0 outside the core)
    norm_after: bool  # model.norm replaces the state after it (the end of a normed repeat)
    injects: bool = False  # the state entering it is adapter(cat[state, e]) first (a repeat's first layer)
    enters_core: bool = False  # the first core layer: the prelude's output becomes the core's input here
    ends_core: bool = False  # the last core layer: the state after it is what the final readout takes


@dataclass(frozen=True)
class DepthPlan:
    prelude: tuple[int, ...]  # blocks run once, on entry
    core: tuple[int, ...]  # blocks of one core repeat
    repeats: int  # R
    coda: tuple[int, ...] = ()  # blocks run at each readout
    loop_norm: bool = False  # model.norm replaces the state after every core repeat (Ouro, Nanbeige)
    final_norm: bool = True  # the final readout's head applies model.norm
    injection: str | None = None  # each repeat reads adapter(cat[state, entry state e]) (Huginn)
    readout_norm: bool = False  # model.norm on the core's state at every readout, before the coda (Huginn's ln_f)
    # With an injection a slot carries two vectors per token, the state and e ([state | e], 2H wide). The
    # core's state starts at zero, or ("random") at STATE_STD x a truncated normal drawn per position
    # under STATE_SEED (speedc/format/initial_state.py), the same in plain decoding and SPEED.
    state_init: str = "zero"
    state_seed: int = 0
    state_std: float = 0.0  # the family's scale of a random start (Huginn: sqrt(2 / (5 H)) * sqrt(H))
    prelude_norm: bool = False  # model.prelude_norm on the prelude's output, the entry state e (Parcae's ln_prelude)
    readout_projection: bool = False  # model.readout ([H, H]) on the core's state at every readout, before the coda (Parcae's C)
    # Cross-repeat attention (IQuest-Coder-V1-Loop), on when > 0: the window W of each later repeat's own K/V;
    # repeat 0's K/V of the same core layer is read in full (positions <= the token's), the two mixed per head.
    cross_window: int = 0
    # Every repeat's normed state is a readout the head reads as it is (Ouro): a request may choose the loops
    # run and the loop read (its exit rules: runtimes/exit_rule.py); needs loop_norm and no prelude or coda.
    loop_exits: bool = False

    def __post_init__(self) -> None:
        if not self.core or self.repeats < 1:
            raise CheckpointError(f"depth plan: a core of at least one block repeated at least once, got "
                                  f"{list(self.core)} x {self.repeats}")
        if self.injection not in INJECTIONS:
            raise CheckpointError(f"depth plan: unknown injection {self.injection!r} (known: {INJECTIONS[1:]})")
        if self.state_init not in STATE_INITS or (self.state_init == "random" and not self.injection):
            raise CheckpointError(f"depth plan: state_init {self.state_init!r} (known: {STATE_INITS}; 'random' needs an "
                                  "injection's recurrent core)")
        if (self.prelude_norm or self.injection) and not self.prelude:
            raise CheckpointError("depth plan: an injection reads the prelude's output e; this plan has no prelude")
        if isinstance(self.cross_window, bool) or not isinstance(self.cross_window, int) or self.cross_window < 0:
            raise CheckpointError(f"depth plan: cross_window must be an integer >= 0, got {self.cross_window!r}")
        if self.loop_exits and (not self.loop_norm or not self.cycle or self.final_norm):
            raise CheckpointError("depth plan: loop exits read each repeat's normed state with the final head: they need "
                                  "a norm after every repeat, no prelude or coda, and no second norm at the head")
        if self.cross_window and (self.prelude or self.coda or self.injection or self.repeats < 2):
            raise CheckpointError("depth plan: cross-repeat attention is built for one core repeated at least twice, "
                                  "without prelude, coda or injection")

    @property
    def recurrent(self) -> bool:
        """A recurrent core (its repeats read the entry state: Huginn, Parcae): a request may run fewer of them
        (its `loops`, Huginn's num_steps), so the programs take where the final readout reads (contract.READOUT_*)."""
        return self.injection is not None

    @property
    def carried_vectors(self) -> int:
        """Vectors a slot carries per token between steps: the state, and e where each repeat reads it."""
        return 2 if self.injection else 1

    # ---- shape ---------------------------------------------------------------------------------
    @property
    def layer_map(self) -> list[int]:
        return [*self.prelude, *self.core * self.repeats, *self.coda]

    @property
    def num_layers(self) -> int:
        return len(self.prelude) + len(self.core) * self.repeats + len(self.coda)

    @property
    def cycle(self) -> bool:
        """Only the repeated core: SPEED's original shape (P identical stages)."""
        return not self.prelude and not self.coda

    def trip(self) -> Iterator[LayerStep]:
        """Every logical layer of one plain trip, in order (models/trip.py walks them)."""
        layer = 0
        for block in self.prelude:
            yield LayerStep(layer, block, PRELUDE, 0, False)
            layer += 1
        last = len(self.core) * self.repeats - 1
        for repeat in range(self.repeats):
            for index, block in enumerate(self.core):
                core_at = repeat * len(self.core) + index
                yield LayerStep(layer, block, CORE, repeat, self.ends_loop(layer), bool(self.injection) and index == 0,
                                enters_core=core_at == 0, ends_core=core_at == last)
                layer += 1
        for block in self.coda:
            yield LayerStep(layer, block, CODA, 0, False)
            layer += 1

    def coda_steps(self) -> list[LayerStep]:
        """The steps a readout runs after its entry (models/trip.read_out)."""
        return [step for step in self.trip() if step.phase == CODA]

    def ends_loop(self, layer: int) -> bool:
        """Whether model.norm follows logical layer LAYER (the end of a core repeat, when the plan norms there)."""
        return self.loop_norm and self.ends_repeat(layer)

    def ends_repeat(self, layer: int) -> bool:
        """Whether logical layer LAYER is the last of a core repeat."""
        core_at = layer - len(self.prelude)
        return 0 <= core_at < len(self.core) * self.repeats and (core_at + 1) % len(self.core) == 0

    def cross_source(self, layer: int) -> int | None:
        """The logical layer whose K/V logical layer LAYER reads across repeats (repeat 0's layer at the same
        core index), or None where it attends only its own K/V."""
        core_at = layer - len(self.prelude)
        if not self.cross_window or not len(self.core) <= core_at < len(self.core) * self.repeats:
            return None
        return len(self.prelude) + core_at % len(self.core)

    def first_repeat_end(self) -> int:
        """Logical layers up to the end of the first core repeat (the default draft tap)."""
        return len(self.prelude) + len(self.core)

    # ---- the pipeline --------------------------------------------------------------------------
    def valid_slots(self, draft_layer: int, pipelined_phases: bool = False) -> list[int]:
        """Pipeline depths P: P divides the repeats and the draft tap lies in slot 0. A plan with a prelude
        or coda pipelines only where PIPELINED_PHASES (the graphs that run them) say so; else plain only."""
        valid = [1]
        if not self.cycle and not (pipelined_phases and draft_layer > len(self.prelude)):
            return valid  # (a draft inside the prelude would not read the core's state at all)
        if self.cross_window:  # one repeat a slot: a slot's later repeat would read repeat 0 inside the same step
            return valid + ([self.repeats] if draft_layer <= len(self.core) else [])
        for slots in range(2, self.repeats + 1):
            if self.repeats % slots == 0 and draft_layer <= len(self.prelude) + len(self.core) * (self.repeats // slots):
                valid.append(slots)
        return valid

    def cache_layout(self, slots: int) -> CacheLayout:
        """Where each layer's K/V lives with this plan pipelined over SLOTS (what the graphs and backends address)."""
        return CacheLayout.from_phases(len(self.prelude), len(self.core), self.repeats, len(self.coda), slots)

    def pipeline(self, slots: int, draft_layer: int) -> "SlotPlan":
        if slots != 1 and self.repeats % slots:
            raise CheckpointError(f"depth plan: {slots} slots do not divide {self.repeats} core repeats")
        return SlotPlan(self, slots, draft_layer)

    # ---- relabelling and JSON ------------------------------------------------------------------
    def fits(self, layer_map: list[int]) -> bool:
        """Whether LAYER_MAP has this plan's phase lengths with every core repeat running the same blocks."""
        if len(layer_map) != self.num_layers:
            return False
        start, size = len(self.prelude), len(self.core)
        first = layer_map[start:start + size]
        return all(layer_map[start + r * size:start + (r + 1) * size] == first for r in range(self.repeats))

    def relabel(self, layer_map: list[int]) -> "DepthPlan":
        """The same phases over LAYER_MAP's block numbers (it must fit)."""
        start, size, tail = len(self.prelude), len(self.core), len(self.coda)
        return replace(self, prelude=tuple(layer_map[:start]), core=tuple(layer_map[start:start + size]),
                       coda=tuple(layer_map[len(layer_map) - tail:]) if tail else ())

    def to_json(self) -> dict:
        return {"prelude": list(self.prelude), "core": list(self.core), "repeats": self.repeats, "coda": list(self.coda),
                "loop_norm": self.loop_norm, "final_norm": self.final_norm, "injection": self.injection,
                "readout_norm": self.readout_norm, "state_init": self.state_init, "state_seed": self.state_seed,
                "state_std": self.state_std, "prelude_norm": self.prelude_norm,
                "readout_projection": self.readout_projection, "cross_window": self.cross_window,
                "loop_exits": self.loop_exits}

    @classmethod
    def from_json(cls, data: dict) -> "DepthPlan":
        try:
            return cls(tuple(data["prelude"]), tuple(data["core"]), int(data["repeats"]), tuple(data.get("coda", ())),
                       bool(data.get("loop_norm", False)), bool(data.get("final_norm", True)), data.get("injection"),
                       bool(data.get("readout_norm", False)), str(data.get("state_init", "zero")),
                       int(data.get("state_seed", 0)), float(data.get("state_std", 0.0)),
                       bool(data.get("prelude_norm", False)), bool(data.get("readout_projection", False)),
                       int(data.get("cross_window", 0)), bool(data.get("loop_exits", False)))
        except (KeyError, TypeError, ValueError) as bad:
            raise CheckpointError(f"depth plan: malformed ({bad!r})") from None

    def describe(self) -> str:
        parts = [f"prelude {list(self.prelude)}" + (" (normed)" if self.prelude_norm else "")] if self.prelude else []
        parts.append(f"core {list(self.core)} x {self.repeats}" + (" (norm each repeat)" if self.loop_norm else ""))
        if self.coda:
            parts.append(f"coda {list(self.coda)}")
        if self.injection:
            start = "from zero" if self.state_init == "zero" else f"random, seed {self.state_seed}, std {self.state_std:.4g}"
            parts.append(f"injection {self.injection} (state {start})")
        if self.readout_norm:
            parts.append("norm at each readout")
        if self.readout_projection:
            parts.append("projection at each readout")
        if self.cross_window:
            parts.append(f"cross-repeat attention (repeat 0's K/V, own window {self.cross_window})")
        if self.loop_exits:
            parts.append("a readout after every repeat (per-request loops and exit rules)")
        return ", ".join(parts)


@dataclass(frozen=True)
class SlotPlan:
    """A depth plan pipelined over SLOTS: which slot runs which phase, and where the readouts are."""
    plan: DepthPlan
    slots: int
    draft_layer: int  # logical layers before the draft readout (inside slot 0)

    @property
    def repeats_per_slot(self) -> int:
        return self.plan.repeats // self.slots if self.slots > 1 else self.plan.repeats

    @property
    def stage_layers(self) -> int:
        """S: the core layers one slot runs a step (P = 1: the whole trip)."""
        if self.slots == 1:
            return self.plan.num_layers
        return len(self.plan.core) * self.repeats_per_slot

    @property
    def stage_blocks(self) -> list[int]:
        """The block sequence every slot's core stage runs (P = 1: the whole layer map)."""
        return self.plan.layer_map[len(self.plan.prelude):len(self.plan.prelude) + self.stage_layers] \
            if self.slots > 1 else self.plan.layer_map

    def entry_steps(self) -> list[LayerStep]:
        """The steps slot 0 runs for the token entering it: the prelude, then one stage of core layers (the
        stage every slot runs: a stage holds whole repeats, so its norms and injections sit alike in each)."""
        return [step for step in self.plan.trip() if step.layer < len(self.plan.prelude) + self.stage_layers]

    def slot_layers(self) -> list[list[int]]:
        """Slot s -> the logical layers it runs: slot 0 the prelude then its repeats; the coda belongs to
        the readouts (listed with the last slot at P = 1, where one trip is one stage)."""
        if self.slots == 1:
            return [list(range(self.plan.num_layers))]
        prelude = len(self.plan.prelude)
        slots = [list(range(prelude + s * self.stage_layers, prelude + (s + 1) * self.stage_layers)) for s in range(self.slots)]
        slots[0] = list(range(prelude)) + slots[0]
        return slots

    def readouts(self) -> dict[str, dict]:
        """Where the heads read: the draft after draft_layer layers of slot 0, the final after slot P-1;
        both through the coda (its own K/V per readout depth) when the plan has one."""
        return {"draft": {"slot": 0, "after_layer": self.draft_layer, "coda": bool(self.plan.coda)},
                "final": {"slot": self.slots - 1, "after_layer": self.plan.num_layers - len(self.plan.coda),
                          "coda": bool(self.plan.coda)}}


# ---- deriving a plan from a layer map ------------------------------------------------------------
def _smallest_period(seq: list[int]) -> int:
    """The shortest p with seq[i] == seq[i + p] for all i and p dividing len(seq) (KMP failure function)."""
    n = len(seq)
    fail = [0] * n
    k = 0
    for i in range(1, n):
        while k and seq[i] != seq[k]:
            k = fail[k - 1]
        if seq[i] == seq[k]:
            k += 1
        fail[i] = k
    period = n - fail[-1] if n else 1
    return period if n % period == 0 else n


def derive_plan(layer_map: list[int], loop_norm: bool = False, final_norm: bool = True) -> DepthPlan:
    """The decomposition prelude + core x R + coda of LAYER_MAP: the whole map as one cycle when it repeats
    (what SPEED pipelines without a prelude or coda), else the decomposition with the most repeats R; among
    those the fewest layers outside the core, then the shortest coda (a coda costs K/V per readout depth)."""
    n = len(layer_map)
    period = _smallest_period(list(layer_map))
    if period < n or len(set(layer_map)) == n:  # one cycle repeated (SPEED's own shape), or nothing repeats at all
        return DepthPlan((), tuple(layer_map[:period]), n // period, loop_norm=loop_norm, final_norm=final_norm)
    best = None
    for outside in range(n):
        for coda in range(outside + 1):
            prelude = outside - coda
            middle = layer_map[prelude:n - coda]
            period = _smallest_period(middle)
            key = (-(len(middle) // period), outside, coda)
            if best is None or key < best[0]:
                best = (key, prelude, period, coda)
        if -best[0][0] >= n - outside - 1:  # a longer prelude + coda leaves no room for more repeats
            break
    _, prelude, period, coda = best
    return DepthPlan(tuple(layer_map[:prelude]), tuple(layer_map[prelude:prelude + period]),
                     (n - prelude - coda) // period, tuple(layer_map[n - coda:]) if coda else (),
                     loop_norm=loop_norm, final_norm=final_norm)


def fit_plan(layer_map: list[int], declared: DepthPlan | None, loop_norm: bool, final_norm: bool) -> DepthPlan:
    """The plan of LAYER_MAP: the DECLARED one (a family's loops, where its norms sit) relabelled when it
    repeats and fits, else derived from the map. The norms are the caller's (ModelConfig's flags)."""
    if declared is not None and (declared.injection or declared.readout_norm or declared.prelude_norm
                                 or declared.readout_projection or declared.cross_window):  # not derivable from a map: it must fit
        if not declared.fits(layer_map):
            raise CheckpointError(f"depth plan ({declared.describe()}) does not fit the layer map {layer_map}")
        return replace(declared.relabel(layer_map), loop_norm=loop_norm, final_norm=final_norm, loop_exits=False)
    if declared is not None and declared.repeats > 1 and declared.fits(layer_map):
        return replace(declared.relabel(layer_map), loop_norm=loop_norm, final_norm=final_norm,
                       loop_exits=declared.loop_exits and loop_norm and not final_norm)
    return derive_plan(layer_map, loop_norm, final_norm)


def with_repeats(plan: DepthPlan, repeats: int) -> DepthPlan:
    """PLAN with its core run REPEATS times (a recurrent-depth model's recurrence, chosen at build)."""
    if repeats < 1:
        raise CheckpointError(f"depth plan: the core must run at least once, got {repeats} repeats")
    return replace(plan, repeats=repeats)


def looped_plan(layers: int, loops: int, *, loop_norm: bool, final_norm: bool, loop_exits: bool = False) -> DepthPlan:
    """A looped checkpoint (Ouro, Nanbeige): the whole stack of LAYERS blocks is the core, run LOOPS times."""
    return DepthPlan((), tuple(range(layers)), loops, (), loop_norm=loop_norm, final_norm=final_norm, loop_exits=loop_exits)
