"""Layer maps: which unique weight block each logical layer uses.

A shared-weight decoder has N logical layers over M unique blocks. The map is a list of N block
indices. Named patterns (registry below) produce it from (N, M):

    cycle         l -> l mod M                  0 1 2 3 0 1 2 3 ...   (SPEED's pipeline shape)
    sequence      l -> l // (N/M)               0 0 0 0 1 1 1 1 ...
    middle-cycle  first, cycled core, last      0 1 2 1 2 1 2 3       (recurrent-depth style)
    explicit      the list as given
"""

from __future__ import annotations

from typing import Callable

from speedc.errors import CheckpointError

PatternFn = Callable[[int, int], list[int]]
LAYER_MAP_PATTERNS: dict[str, PatternFn] = {}


def register_pattern(name: str) -> Callable[[PatternFn], PatternFn]:
    def wrap(fn: PatternFn) -> PatternFn:
        LAYER_MAP_PATTERNS[name] = fn
        return fn

    return wrap


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckpointError(message)


@register_pattern("cycle")
def cycle_map(num_layers: int, num_blocks: int) -> list[int]:
    _require(num_layers % num_blocks == 0, f"cycle layer map: {num_layers} layers is not a multiple of {num_blocks} blocks")
    return [layer % num_blocks for layer in range(num_layers)]


@register_pattern("sequence")
def sequence_map(num_layers: int, num_blocks: int) -> list[int]:
    _require(num_layers % num_blocks == 0, f"sequence layer map: {num_layers} layers is not a multiple of {num_blocks} blocks")
    repeat = num_layers // num_blocks
    return [layer // repeat for layer in range(num_layers)]


@register_pattern("middle-cycle")
def middle_cycle_map(num_layers: int, num_blocks: int) -> list[int]:
    # Block 0 is the unshared first layer, block M-1 the unshared last one, blocks 1..M-2 the core.
    core = num_blocks - 2
    _require(core >= 1, f"middle-cycle layer map needs at least 3 blocks, got {num_blocks}")
    _require(
        num_layers >= 3 and (num_layers - 2) % core == 0,
        f"middle-cycle layer map: {num_layers} - 2 layers is not a multiple of the {core}-block core",
    )
    return [0] + [1 + i % core for i in range(num_layers - 2)] + [num_blocks - 1]


def resolve_layer_map(spec: object, num_layers: int) -> list[int]:
    """Turn a config's layer-map spec into the explicit list of N block indices.

    spec is either a list of ints, or {"pattern": NAME, "num_blocks": M} (or {"pattern": "explicit",
    "map": [...]}).
    """
    if isinstance(spec, list):
        layer_map = spec
    elif isinstance(spec, dict):
        pattern = spec.get("pattern")
        if pattern == "explicit":
            layer_map = spec.get("map")
            _require(isinstance(layer_map, list), "explicit layer map needs a 'map' list")
        elif pattern in LAYER_MAP_PATTERNS:
            num_blocks = spec.get("num_blocks")
            _require(isinstance(num_blocks, int) and num_blocks >= 1, f"layer map pattern '{pattern}' needs a positive 'num_blocks'")
            layer_map = LAYER_MAP_PATTERNS[pattern](num_layers, num_blocks)
        else:
            known = ", ".join(sorted([*LAYER_MAP_PATTERNS, "explicit"]))
            raise CheckpointError(f"unknown layer-map pattern {pattern!r} (known: {known})")
    else:
        raise CheckpointError(f"layer map must be a list or a {{pattern, num_blocks}} object, got {type(spec).__name__}")
    validate_layer_map(layer_map, num_layers)
    return list(layer_map)


def validate_layer_map(layer_map: list, num_layers: int) -> None:
    _require(all(isinstance(b, int) and not isinstance(b, bool) for b in layer_map), "layer map entries must be integers")
    _require(
        len(layer_map) == num_layers,
        f"layer map has {len(layer_map)} entries but the model has {num_layers} layers (num_hidden_layers)",
    )
    _require(min(layer_map) >= 0, "layer map has a negative block index")
    used = set(layer_map)
    num_blocks = max(layer_map) + 1
    missing = sorted(set(range(num_blocks)) - used)
    _require(not missing, f"layer map never uses blocks {missing}: blocks must be numbered 0..M-1")


def describe_layer_map(layer_map: list[int]) -> str:
    """Name the pattern a list follows, for display ('cycle M=4', 'explicit')."""
    num_layers, num_blocks = len(layer_map), max(layer_map) + 1
    for name, fn in LAYER_MAP_PATTERNS.items():
        try:
            if fn(num_layers, num_blocks) == list(layer_map):
                return f"{name} (M={num_blocks})"
        except CheckpointError:
            continue
    return f"explicit (M={num_blocks})"


def first_pass_length(layer_map: list[int]) -> int:
    """Layers until a block repeats: the default exit point (the end of the first pass)."""
    seen: set[int] = set()
    for layer, block in enumerate(layer_map):
        if block in seen:
            return layer
        seen.add(block)
    return len(layer_map)
