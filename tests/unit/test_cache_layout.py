"""speedc/format/cache_layout.py: every cache entry has one address, the slabs a graph names are views of
the pool at that address, and new rows land where a later read finds them (checked against loops
written from the layout's description, not from its code)."""

from __future__ import annotations

import numpy as np
import pytest

from speedc.format import contract
from speedc.format.cache_layout import CODA, CORE, PRELUDE, Address, CacheLayout
from speedc.format.depth_plan import DepthPlan
from speedc.errors import ArtifactError

KVH, T, HD, W = 2, 6, 4, 3


def pools_for(layout: CacheLayout, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {phase: tuple(rng.standard_normal(layout.pool_shape(phase, W, KVH, T, HD)).astype(np.float32)
                         for _ in contract.KV_KINDS) for phase in layout.phases}


def test_cycle_layout_is_stage_layer_by_slot():
    layout = CacheLayout.cycle(stage_layers=3, slots=4)
    assert layout.num_layers == 12 and layout.phases == [CORE]
    for layer in range(12):  # SPEED.md: slot s at block m computes logical layer s*M + m
        assert layout.locate(layer) == Address(CORE, layer // 3, layer % 3)
    pools = pools_for(layout)
    slabs = layout.prefill_slabs(pools, slice(1, 3))
    for layer in range(12):
        view = slabs[contract.cache_input("key", layer)]
        assert np.shares_memory(view, pools[CORE][0])  # a view, never a copy
        np.testing.assert_array_equal(view, pools[CORE][0][layer % 3, layer // 3, 1:3])


def test_step_slabs_standard_and_fused():
    layout = CacheLayout.cycle(stage_layers=2, slots=3)
    pools = pools_for(layout)
    standard = layout.step_slabs(pools, 2, fused=False)
    fused = layout.step_slabs(pools, 2, fused=True)
    assert len(standard) == 2 * 2 * 3 and len(fused) == 2 * 2
    for j in range(2):
        whole = fused[contract.pool_input("value", j)]  # [P*W, kvh, T+1, hd], row s*W + b
        assert whole.shape == (3 * W, KVH, T + 1, HD) and np.shares_memory(whole, pools[CORE][1])
        for s in range(3):
            slab = standard[contract.batch_cache_input("value", j, s)]
            assert slab.shape == (2, KVH, T + 1, HD)
            for b in range(2):
                np.testing.assert_array_equal(whole[s * W + b], slab[b])


def test_prefill_rows_land_where_each_layer_reads_them():
    layout = CacheLayout.cycle(stage_layers=2, slots=2)
    pools = pools_for(layout)
    expected = {kind: pool.copy() for kind, pool in zip(contract.KV_KINDS, pools[CORE])}
    rng = np.random.default_rng(1)
    lengths, start, first = [3, 1], 2, 1
    new = {kind: rng.standard_normal((4, 2, KVH, 3, HD)).astype(np.float32) for kind in contract.KV_KINDS}
    layout.write_prefill_rows(pools, new, first, start, lengths)
    for kind in contract.KV_KINDS:
        for layer in range(4):
            for row, length in enumerate(lengths):  # only the real tokens: padding never lands
                expected[kind][layer % 2, layer // 2, first + row, :, start:start + length] = new[kind][layer, row, :, :length]
    for kind, pool in zip(contract.KV_KINDS, pools[CORE]):
        np.testing.assert_array_equal(pool, expected[kind])


def test_token_and_step_rows():
    layout = CacheLayout.cycle(stage_layers=2, slots=3)
    pools = pools_for(layout)
    expected = {kind: pool.copy() for kind, pool in zip(contract.KV_KINDS, pools[CORE])}
    rng = np.random.default_rng(2)
    # plain decoding: one token per pool row, rows 0 and 2 valid
    rows, positions = np.array([0, 2]), np.array([4, 0, 1])
    new = {kind: rng.standard_normal((6, 3, KVH, 1, HD)).astype(np.float32) for kind in contract.KV_KINDS}
    layout.write_token_rows(pools, new, rows, positions)
    for kind in contract.KV_KINDS:
        for layer in range(6):
            for b in rows:
                expected[kind][layer % 2, layer // 2, b, :, positions[b]] = new[kind][layer, b, :, 0]
    # a batch step: n = 2 sequences x 3 slots, row s*n + b; bubbles (invalid) never write
    valid = np.array([[True, False], [True, True], [False, True]])
    step_positions = np.array([[5, 0], [4, 3], [0, 2]])
    step_new = {kind: rng.standard_normal((2, 6, KVH, 1, HD)).astype(np.float32) for kind in contract.KV_KINDS}
    layout.write_step_rows(pools, step_new, 3, 2, valid, step_positions)
    for kind in contract.KV_KINDS:
        for s in range(3):
            for b in range(2):
                if valid[s, b]:
                    for j in range(2):
                        expected[kind][j, s, b, :, step_positions[s, b]] = step_new[kind][j, s * 2 + b, :, 0]
    for kind, pool in zip(contract.KV_KINDS, pools[CORE]):
        np.testing.assert_array_equal(pool, expected[kind])


def middle_cycle_plan() -> DepthPlan:
    # layer map [0, 1, 2, 1, 2, 1, 2, 3]: one layer, a 2-block core x 3, one layer
    return DepthPlan((0,), (1, 2), 3, (3,))


def test_middle_cycle_layout_owns_coda_kv_per_readout():
    layout = middle_cycle_plan().cache_layout(3)
    assert (layout.prelude_layers, layout.stage_layers, layout.slots, layout.coda_layers, layout.readouts) == (1, 2, 3, 1, 2)
    assert layout.phases == [CORE, PRELUDE, CODA]
    entries = layout.entries
    assert len(entries) == len(set(entries)) == 8 + 1  # N logical layers + the draft readout's coda
    assert [layout.locate(layer) for layer in range(8)] == [
        Address(PRELUDE, 0, 0), Address(CORE, 0, 0), Address(CORE, 0, 1), Address(CORE, 1, 0), Address(CORE, 1, 1),
        Address(CORE, 2, 0), Address(CORE, 2, 1), Address(CODA, 1, 0)]  # the plain trip's coda is the final readout's
    assert entries[8] == Address(CODA, 0, 0)  # the draft readout's own coda K/V
    assert layout.pool_shape(CODA, W, KVH, T, HD) == (1, 2, W, KVH, T + 1, HD)
    pools = pools_for(layout)
    slabs = layout.prefill_slabs(pools, slice(0, 1))
    assert len(slabs) == 2 * 8  # the prefill reads the trip's layers (it only writes the draft readout's coda)
    final = slabs[contract.cache_input("key", 7)]
    assert np.shares_memory(final, pools[CODA][0][0, 1]) and not np.shares_memory(final, pools[CODA][0][0, 0])
    step = layout.step_slabs(pools, 2, fused=False)
    assert len(step) == 2 * (2 * 3 + 1 + 2)  # core (j, s), the prelude, the coda at both readout depths
    assert np.shares_memory(step[contract.phase_cache_input("value", PRELUDE, 0)], pools[PRELUDE][1])
    np.testing.assert_array_equal(step[contract.phase_cache_input("key", CODA, 0, 1)], pools[CODA][0][0, 1, :2])
    with pytest.raises(ArtifactError, match="not pipelined"):
        layout.step_slabs(pools, 2, fused=True)  # the fused variant runs a cycle only


def test_middle_cycle_step_rows_write_each_readout_depth_from_its_own_slot():
    """Slot 0's rows write the prelude and the draft readout's coda; slot P-1's the final readout's coda;
    bubbles nothing (positions are each sequence's own)."""
    layout = middle_cycle_plan().cache_layout(3)
    pools = pools_for(layout)
    expected = {phase: [pool.copy() for pool in pair] for phase, pair in pools.items()}
    rng = np.random.default_rng(3)
    n = 2
    valid = np.array([[True, False], [True, True], [False, True]])
    positions = np.array([[5, 0], [4, 3], [0, 2]])
    new = {}
    for k, kind in enumerate(contract.KV_KINDS):
        new[kind] = rng.standard_normal((2, 3 * n, KVH, 1, HD)).astype(np.float32)
        new[(kind, PRELUDE)] = rng.standard_normal((1, n, KVH, 1, HD)).astype(np.float32)
        new[(kind, CODA)] = rng.standard_normal((1, 2, n, KVH, 1, HD)).astype(np.float32)
        for s in range(3):
            for b in range(n):
                if valid[s, b]:
                    for j in range(2):
                        expected[CORE][k][j, s, b, :, positions[s, b]] = new[kind][j, s * n + b, :, 0]
        for b in range(n):
            if valid[0, b]:  # entering slot 0: prelude and draft coda at its position
                expected[PRELUDE][k][0, 0, b, :, positions[0, b]] = new[(kind, PRELUDE)][0, b, :, 0]
                expected[CODA][k][0, 0, b, :, positions[0, b]] = new[(kind, CODA)][0, 0, b, :, 0]
            if valid[2, b]:  # leaving slot P-1: the final readout's coda
                expected[CODA][k][0, 1, b, :, positions[2, b]] = new[(kind, CODA)][0, 1, b, :, 0]
    layout.write_step_rows(pools, new, 3, n, valid, positions)
    for phase, pair in pools.items():
        for k in range(2):
            np.testing.assert_array_equal(pair[k], expected[phase][k])


def test_plain_engine_is_one_stage_and_bad_slot_counts_refused():
    layout = middle_cycle_plan().cache_layout(1)
    assert layout == CacheLayout.plain(8) and layout.phases == [CORE]
    with pytest.raises(ArtifactError, match="do not divide"):
        middle_cycle_plan().cache_layout(2)
