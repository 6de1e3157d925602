"""Named model shapes for `speedc train --preset`. Each returns the config fields a new model needs
(vocab size comes from the tokenizer trained alongside)."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Fast enough for the test suite: 2 unique blocks x 4 passes, ~2 MB.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, layer_map={"pattern": "cycle", "num_blocks": 2}, vocab_size=1024,
                 max_position_embeddings=512, exit_layer=2),
    # The demo and benchmark model: 4 unique blocks x 4 passes (N=16), hidden 384.
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=6,
                  num_key_value_heads=2, layer_map={"pattern": "cycle", "num_blocks": 4}, vocab_size=4096,
                  max_position_embeddings=1024, exit_layer=4),
    # The paper table (benchmarks/paper_table.py): unique blocks x passes at one hidden size, trained
    # with the same budget. 2x4 is the shared-weight model SPEED runs with P=4; 2x1 has its parameters
    # and a quarter of its depth, 8x1 its depth with four times the parameters.
    **{f"paper-{blocks}x{passes}": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=blocks * passes, num_attention_heads=4,
        num_key_value_heads=2, layer_map={"pattern": "cycle", "num_blocks": blocks}, vocab_size=4096,
        max_position_embeddings=1024, exit_layer=min(2, blocks * passes))
       for blocks, passes in ((2, 1), (2, 4), (8, 1))},
    # A handful of steps on a few KB of text: the training test.
    "test": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, layer_map={"pattern": "cycle", "num_blocks": 2}, vocab_size=300,
                 max_position_embeddings=128, exit_layer=2),
}
