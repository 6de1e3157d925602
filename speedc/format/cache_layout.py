"""The KV-cache layout: where each logical layer's K/V lives, for every graph and backend.

A token's trip through the model is a depth plan (speedc/format/depth_plan.py; the manifest records it as
JSON): prelude layers once, a core of C layers repeated R times, coda layers at each readout. In
the SPEED pipeline P slots each run K = R/P core repeats; one stage is S = K*C layers (slot 0 also
runs the prelude, see below). Every K/V row belongs to one (phase, column, layer) address:

    phase "core"     column = pipeline slot s (0..P-1), layer = stage layer j (0..S-1)
                     logical layer  prelude + s*S + j          pool [S, P, W, kvh, T+1, hd]
    phase "prelude"  column 0, layer i                         pool [Lp, 1, W, kvh, T+1, hd]
    phase "coda"     column = readout r (draft 0, final 1)     pool [Lc, 2, W, kvh, T+1, hd]
                     each readout owns its coda K/V: the final readout's coda only ever sees
                     final states, whatever the draft readout computed

With P = 1 (a plain engine) the whole trip is one stage: one "core" pool [N, 1, ...] and nothing
else. Cross-repeat attention (IQuest-Coder-V1-Loop) needs no address of its own: every slot's rows of
stage layer j also read slot 0's slab pool[j, 0] (repeat 0's K/V), as logical layer r*S + j reads layer j. A cycle model (no prelude, no coda) has the "core" pool alone: slot s's rows of stage layer j
are pool[j, s], logical layer s*S + j, contiguous for the sequences 0..n-1 (no gather).

The programs name the slabs they read (speedc/format/contract.py): the prefill one per logical layer
(cache.{kind}.{e}, entry e < N in `entries` order), the batch step one per (stage layer, slot)
(cache.{kind}.{j}.{s}), its fused variant one per stage layer (pool.{kind}.{j}, the slots and
sequences of pool[j] as one [P*W, ...] buffer).

Standard library + numpy: the passes and the runtimes both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from speedc.format import contract
from speedc.errors import ArtifactError

CORE, PRELUDE, CODA = "core", "prelude", "coda"
DRAFT_READOUT = 0  # coda column of the draft readout; the final readout's is the last (readouts - 1)


@dataclass(frozen=True)
class Address:
    """Where one cache entry's K/V rows live: POOL's [layer, column] slab (column: the slot, or the readout)."""
    phase: str
    column: int
    layer: int


@dataclass(frozen=True)
class CacheLayout:
    prelude_layers: int  # Lp
    stage_layers: int  # S: layers of one slot's share of the core (K repeats x C layers)
    slots: int  # P
    coda_layers: int = 0  # Lc
    readouts: int = 1  # readouts whose coda owns K/V (1: no pipeline readout besides the final one)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def plain(cls, num_layers: int) -> "CacheLayout":
        """A plain engine: every layer in one stage, one slot."""
        return cls(0, num_layers, 1)

    @classmethod
    def cycle(cls, stage_layers: int, slots: int) -> "CacheLayout":
        return cls(0, stage_layers, slots)

    @classmethod
    def from_phases(cls, prelude: int, core: int, repeats: int, coda: int, slots: int) -> "CacheLayout":
        """A trip of PRELUDE layers, a CORE-layer core run REPEATS times and CODA layers, pipelined over SLOTS."""
        if slots == 1:  # the plain engine runs the whole trip as one stage
            return cls.plain(prelude + core * repeats + coda)
        if repeats % slots:
            raise ArtifactError(f"{slots} pipeline slots do not divide the plan's {repeats} core repeats")
        return cls(prelude, core * (repeats // slots), slots, coda, 2 if coda else 1)

    @classmethod
    def from_manifest(cls, manifest) -> "CacheLayout":
        """The layout an artifact's graphs were built for."""
        return manifest.depth_plan.cache_layout(manifest.slots)

    # ---- addressing --------------------------------------------------------------------------
    @property
    def core_layers(self) -> int:
        return self.stage_layers * self.slots

    @property
    def num_layers(self) -> int:
        """Logical layers of one plain trip (prelude, every core repeat, the coda once)."""
        return self.prelude_layers + self.core_layers + self.coda_layers

    @cached_property
    def entries(self) -> tuple[Address, ...]:
        """Every cache entry in the prefill graph's order: the N logical layers of a plain trip (the coda
        at the final readout), then the coda K/V of the earlier readouts."""
        final = self.readouts - 1
        out = [Address(PRELUDE, 0, i) for i in range(self.prelude_layers)]
        out += [Address(CORE, s, j) for s in range(self.slots) for j in range(self.stage_layers)]
        out += [Address(CODA, final, i) for i in range(self.coda_layers)]
        out += [Address(CODA, d, i) for d in range(final) for i in range(self.coda_layers)]
        return tuple(out)

    @cached_property
    def _by_phase(self) -> dict[str, tuple[slice, np.ndarray, np.ndarray]]:
        """phase -> (its entries' span, their pool layers, their pool columns [e]): a phase's entries are
        contiguous (`entries`), so NEW[kind][span] is a view, not a copy of the new rows."""
        grouped = {}
        for phase in self.phases:
            picked = [(i, at.layer, at.column) for i, at in enumerate(self.entries) if at.phase == phase]
            indices, layers, columns = (np.asarray(column, np.int64) for column in zip(*picked))
            assert (np.diff(indices) == 1).all(), f"{phase} entries are not contiguous"
            grouped[phase] = (slice(int(indices[0]), int(indices[-1]) + 1), layers, columns)
        return grouped

    def locate(self, layer: int) -> Address:
        """The address of logical layer LAYER of a plain trip (0..N-1)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"logical layer {layer} outside 0..{self.num_layers - 1}")
        return self.entries[layer]

    def pool_layers(self, phase: str) -> tuple[int, int]:
        """(layers, columns) of PHASE's pool; (0, 0) when the layout has none."""
        return {CORE: (self.stage_layers, self.slots), PRELUDE: (self.prelude_layers, 1 if self.prelude_layers else 0),
                CODA: (self.coda_layers, self.readouts if self.coda_layers else 0)}[phase]

    @property
    def phases(self) -> list[str]:
        return [phase for phase in (CORE, PRELUDE, CODA) if self.pool_layers(phase)[0]]

    def pool_shape(self, phase: str, width: int, kv_heads: int, length: int, head_dim: int) -> tuple[int, ...]:
        """PHASE's pool for WIDTH pool rows of LENGTH positions (+1: the scratch row bubbles write)."""
        layers, columns = self.pool_layers(phase)
        return (layers, columns, width, kv_heads, length + 1, head_dim)

    @property
    def pipelined_phases(self) -> bool:
        """Whether a pipeline step needs more than the core pool (a prelude or coda beside the slots)."""
        return self.phases != [CORE]

    @property
    def prefill_reads(self) -> int:
        """Cache entries the prefill graph reads: the N logical layers, and where a draft readout runs a coda of
        Lc > 1 layers its first Lc - 1 (each feeds the next coda layer, whose K/V the prefill writes; the
        last one's attention feeds only the draft head, which the prefill does not have)."""
        return self.num_layers + (self.coda_layers - 1 if self.readouts > 1 and self.coda_layers else 0)

    # ---- the slabs a graph input names -------------------------------------------------------
    def prefill_slabs(self, pools: dict[str, tuple[np.ndarray, np.ndarray]], rows: slice) -> dict[str, np.ndarray]:
        """Prefill-graph cache inputs over pool rows ROWS: entry e reads its pool[layer, column, rows]: the N
        logical layers, then the draft readout's coda layers but its last (prefill_reads)."""
        slabs = {}
        for index, at in enumerate(self.entries[:self.prefill_reads]):
            for kind, pool in zip(contract.KV_KINDS, pools[at.phase]):
                slabs[contract.cache_input(kind, index)] = pool[at.layer, at.column, rows]  # [B, kvh, T+1, hd]
        return slabs

    def step_slabs(self, pools: dict[str, tuple[np.ndarray, np.ndarray]], n: int, fused: bool) -> dict[str, np.ndarray]:
        """Batch-step cache inputs: fused, stage layer j's whole core pool [P*W, kvh, T+1, hd] (one attention
        a layer); standard, one slab pool[j, s, :n] per (stage layer, slot), and the phases' slabs:
        prelude layer i pool[i, 0, :n], coda layer i of readout r pool[i, r, :n]."""
        if fused:
            self._core_only("the fused batch step")
        views = {}
        for kind, pool in zip(contract.KV_KINDS, pools.get(PRELUDE, ())):
            for i in range(self.prelude_layers):
                views[contract.phase_cache_input(kind, PRELUDE, i)] = pool[i, 0, :n]  # [n, kvh, T+1, hd]
        for kind, pool in zip(contract.KV_KINDS, pools.get(CODA, ())):
            for i in range(self.coda_layers):
                for readout in range(self.readouts):
                    views[contract.phase_cache_input(kind, CODA, i, readout)] = pool[i, readout, :n]
        for j in range(self.stage_layers):
            for kind, pool in zip(contract.KV_KINDS, pools[CORE]):
                if fused:
                    views[contract.pool_input(kind, j)] = pool[j].reshape(-1, *pool.shape[3:])  # [P*W, kvh, T+1, hd]
                else:
                    for s in range(self.slots):
                        views[contract.batch_cache_input(kind, j, s)] = pool[j, s, :n]  # [n, kvh, T+1, hd]
        return views

    # ---- new rows a standard graph returns, in pool order ------------------------------------
    def write_prefill_rows(self, pools: dict[str, tuple[np.ndarray, np.ndarray]], new: dict[str, np.ndarray],
                           first: int, start: int, lengths) -> None:
        """Prefill's new rows NEW[kind] [E, B, kvh, L, hd] (entry e, chunk row b) into the pools: row b is
        pool row first + b at positions start .. start + lengths[b] - 1 (its padding dropped)."""
        for phase, (span, layers, columns) in self._by_phase.items():
            for kind, pool in zip(contract.KV_KINDS, pools[phase]):
                rows = new[kind][span]  # [e, B, kvh, L, hd] (a view)
                for row, length in enumerate(lengths):  # advanced (layers, columns, slot) first: [e, kvh, length, hd]
                    pool[layers, columns, first + row, :, start:start + length] = rows[:, row, :, :length]

    def write_token_rows(self, pools: dict[str, tuple[np.ndarray, np.ndarray]], new: dict[str, np.ndarray],
                         rows: np.ndarray, positions: np.ndarray) -> None:
        """Plain decoding's new rows NEW[kind] [E, n, kvh, 1, hd]: pool row b of ROWS at positions[b]."""
        for phase, (span, layers, columns) in self._by_phase.items():
            for kind, pool in zip(contract.KV_KINDS, pools[phase]):
                part = new[kind][span][:, rows][:, :, :, 0]  # [e, k, kvh, hd]: the span a view, the rows one copy
                # advanced indices (entries x rows, positions) split by a slice: the target is [e, k, kvh, hd]
                pool[layers[:, None], columns[:, None], rows[None], :, positions[rows][None]] = part

    def write_step_rows(self, pools: dict[str, tuple[np.ndarray, np.ndarray]], new: dict[str, np.ndarray],
                        slots: int, n: int, valid: np.ndarray, positions: np.ndarray,
                        readout_slots: np.ndarray | None = None) -> None:
        """The batch step's new rows NEW[kind] [S, P*n, kvh, 1, hd] (row s*n + b) into pool[j, s, b, :, positions[s, b]]
        for the valid (slot, sequence) pairs only (bubbles never write). With phases, NEW[(kind, PRELUDE)]
        [Lp, n, kvh, 1, hd] are slot 0's rows, NEW[(kind, CODA)] [Lc, 2, n, kvh, 1, hd] the draft readout's
        (slot 0's rows) and the final readout's (sequence b's in slot READOUT_SLOTS[b]; None: P-1): each readout
        writes only its own K/V."""
        s_index, b_index = np.nonzero(valid)
        at = positions[s_index, b_index]
        for kind, pool in zip(contract.KV_KINDS, pools[CORE]):
            rows = new[kind][:, :, :, 0].reshape(self.stage_layers, slots, n, *pool.shape[3:4], -1)  # [S, P, n, kvh, hd]
            pool[:, s_index, b_index, :, at] = rows[:, s_index, b_index].transpose(1, 0, 2, 3)
        entering = np.flatnonzero(valid[0])
        readout_slots = np.full(n, slots - 1) if readout_slots is None else readout_slots
        leaving = np.flatnonzero(valid[readout_slots, np.arange(n)])  # sequences whose final readout read a token
        for kind, pool in zip(contract.KV_KINDS, pools.get(PRELUDE, ())):
            rows = new[(kind, PRELUDE)][:, :, :, 0]  # [Lp, n, kvh, hd]
            pool[:, 0, entering, :, positions[0, entering]] = rows[:, entering].transpose(1, 0, 2, 3)  # target [k, Lp, kvh, hd]
        for kind, pool in zip(contract.KV_KINDS, pools.get(CODA, ())):
            rows = new[(kind, CODA)][:, :, :, :, 0]  # [Lc, 2, n, kvh, hd]
            for readout, picked, at in ((DRAFT_READOUT, entering, positions[0, entering]),
                                        (self.readouts - 1, leaving, positions[readout_slots[leaving], leaving])):
                pool[:, readout, picked, :, at] = rows[:, readout, picked].transpose(1, 0, 2, 3)

    def _core_only(self, what: str) -> None:
        if self.pipelined_phases:
            raise ArtifactError(f"internal: {what} of this build runs a single cycle; the plan's "
                                f"{', '.join(p for p in self.phases if p != CORE)} is not pipelined yet")
