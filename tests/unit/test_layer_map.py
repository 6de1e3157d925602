import pytest

from speedc.errors import CheckpointError
from speedc.models.layer_map import describe_layer_map, resolve_layer_map


@pytest.mark.parametrize("spec, n, expected", [
    ({"pattern": "cycle", "num_blocks": 4}, 8, [0, 1, 2, 3, 0, 1, 2, 3]),
    ({"pattern": "sequence", "num_blocks": 2}, 6, [0, 0, 0, 1, 1, 1]),
    ({"pattern": "middle-cycle", "num_blocks": 4}, 8, [0, 1, 2, 1, 2, 1, 2, 3]),
    ({"pattern": "explicit", "map": [0, 1, 1, 0]}, 4, [0, 1, 1, 0]),
    ([0, 0, 1], 3, [0, 0, 1]),
])
def test_patterns(spec, n, expected):
    assert resolve_layer_map(spec, n) == expected


def test_describe_names_the_pattern():
    assert describe_layer_map([0, 1, 0, 1]) == "cycle (M=2)"
    assert describe_layer_map([0, 2, 1]) == "explicit (M=3)"


@pytest.mark.parametrize("spec, n, message", [
    ({"pattern": "spiral", "num_blocks": 2}, 4, "unknown layer-map pattern 'spiral'"),
    ({"pattern": "cycle", "num_blocks": 3}, 4, "not a multiple"),
    ([0, 1, 0], 4, "has 3 entries but the model has 4 layers"),
    ([0, 2, 0, 2], 4, "never uses blocks [1]"),
    ({"pattern": "middle-cycle", "num_blocks": 2}, 4, "at least 3 blocks"),
    ("cycle", 4, "must be a list"),
])
def test_bad_layer_maps(spec, n, message):
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_layer_map(spec, n)
