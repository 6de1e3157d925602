"""The PyTorch batch backend (runtimes/backends/torch_backend.py) under the continuous-batching scheduler: on
random models (several layer maps, P = 2, 3, 4, grouped-query and multi-query attention, a looped
model with sandwich norms), its ids equal ONNX Runtime's batch backend (fused and standard graphs) and
plain decoding with the PyTorch reference, for one and three sequences, greedy and seeded sampling,
early flush on; its pool follows BatchBackend's sizing rules, bubbles write only the scratch row, ties break as ONNX
Runtime's do, and a pool that cannot grow is OutOfMemory for that request alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from conftest import build_artifact, random_config, randomize
from speedc.format import contract
from speedc.format.artifact import read_manifest
from speedc.errors import GenerationError, OutOfMemory, SpeedcError
from speedc.models.generate import generate as reference_generate
from speedc.models.llama import SharedLlama
from speedc.models.sampling import SamplingParams, TokenPicker
from speedc.runtimes.backends import torch_backend
from speedc.runtimes.batch import BatchScheduler
from speedc.runtimes.speculation import RowPolicy
from speedc.runtimes.backends.onnx import BatchBackend
from speedc.runtimes.backends.protocol import HeadRows
from speedc.runtimes.decode import Request
from speedc.runtimes.backends.torch_backend import TorchBackend, best_candidate, top_candidates

CAPACITY = 64
PROMPTS = [[5, 9, 2, 14], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40]]
NEW_TOKENS = [20, 13, 17]  # sequences end at different steps: the last occupied slot moves into the hole
SAMPLING = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, top_k=40, seed=11)}


def _looped(**shape) -> object:
    """A looped model's config: model.norm after every pass, sandwich norms, heads on the normed state."""
    cfg = random_config(exit_norm="none", **shape)
    return dataclasses.replace(cfg, depth_plan=dataclasses.replace(cfg.depth_plan, loop_norm=True, final_norm=False),
                               sandwich_norms=True)


CONFIGS = {
    "cycle-P3-gqa": lambda: random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64),  # head_dim 16: fused graphs
    "cycle-P4-mqa-untied": lambda: random_config(blocks=2, layers=8, heads=4, kv_heads=1, tie=False),  # head_dim 8
    "explicit-P2-exit-inside": lambda: random_config(layer_map=[0, 1, 1, 0, 1, 1], layers=6, exit_layer=2, heads=4,
                                                     kv_heads=2, hidden=64),
    "looped-P3-sandwich": lambda: _looped(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64),
}
SLOTS = {"cycle-P3-gqa": 3, "cycle-P4-mqa-untied": 4, "explicit-P2-exit-inside": 2, "looped-P3-sandwich": 3}


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory):
    """(name, model, artifact, manifest, {backend name: batch backend}) for one random model."""
    model = randomize(SharedLlama(CONFIGS[request.param]()), seed=31)
    art = build_artifact(model, tmp_path_factory.mktemp("torch-batch") / request.param)
    manifest = read_manifest(art)
    assert manifest.slots == SLOTS[request.param]
    backends = {"torch": TorchBackend(art, manifest, max_batch=3, capacity=CAPACITY)}
    for fused in (True, False):
        if not fused or contract.fused(contract.BATCH_STEP) in manifest.graphs:
            backends["onnx " + ("fused" if fused else "standard")] = BatchBackend(art, manifest, 3, CAPACITY, fused=fused)
    return request.param, model, art, manifest, backends


def _request(prompt: list[int], new_tokens: int, params: SamplingParams) -> Request:
    return Request(list(prompt), new_tokens, TokenPicker(params), stop=lambda ids: None)


def _decode(backend, prompts, new_tokens, params, *, speculate: bool = True, arrive_every: int = 0, watch=None):
    """Run PROMPTS through a BatchScheduler on BACKEND (speed steps, or plain ones), one submitted every
    ARRIVE_EVERY steps (0: all at once), WATCH(scheduler) after each step; -> the finished sequences."""
    scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=None if speculate else 0))
    pending = [_request(p, n, params) for p, n in zip(prompts, new_tokens)]
    sequences, step = [], 0
    while pending or scheduler.busy:
        if pending and (arrive_every == 0 or step % arrive_every == 0):
            for request in pending if arrive_every == 0 else pending[:1]:
                sequences.append(scheduler.submit(request, early_flush=True))
            pending = [] if arrive_every == 0 else pending[1:]
        scheduler.step()
        if watch is not None:
            watch(scheduler)
        step += 1
    assert all(s.stats.stop_reason == "max_new_tokens" for s in sequences)
    return sequences


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("count", [1, 3])
def test_ids_equal_onnx_batch_backend_and_plain_decoding(case, sampling, count):
    """Every backend's SPEED ids, and the PyTorch backend's plain-step ids, equal the reference decoder's;
    the runs really speculated and really mispredicted (a random model's exit head often errs)."""
    name, model, _, _, backends = case
    params, prompts, lengths = SAMPLING[sampling], PROMPTS[:count], NEW_TOKENS[:count]
    expected = [reference_generate(model, p, n, params) for p, n in zip(prompts, lengths)]
    for label, backend in backends.items():
        sequences = _decode(backend, prompts, lengths, params)
        assert [s.out for s in sequences] == expected, (name, label)
        if label == "torch":
            assert sum(s.stats.mispredicted for s in sequences) > 0
            if backend.slots > 2:  # early-flush checks exist from P = 3 (slots 1..P-2)
                assert sum(s.stats.early_flushes for s in sequences) > 0
    plain = _decode(backends["torch"], prompts, lengths, params, speculate=False)
    assert [s.out for s in plain] == expected
    assert all(s.stats.accepted == s.stats.mispredicted == 0 for s in plain)


def _perturbed_exit(model: SharedLlama, strength: float) -> SharedLlama:
    """Noise on the exit norm: the exit head disagrees with the final head far more often (the final
    head, hence the correct output, untouched)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.model.exit_norm.weight.mul_(1 + strength * torch.randn(model.model.exit_norm.weight.shape, generator=gen))
    return model


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_forced_mispredictions_with_staggered_arrivals_and_a_growing_pool(sampling):
    """A perturbed exit head (P = 4, early flush on): sequences arrive two steps apart while others
    decode, the pool grows under them (min_length 8: longer and wider) and shrinks after one call,
    finished ones leave holes filled by moves; every sequence still equals plain decoding of it alone."""
    model = _perturbed_exit(randomize(SharedLlama(random_config(blocks=2, layers=8, heads=4, kv_heads=2, hidden=64)),
                                      seed=8), strength=3.0)
    params = SAMPLING[sampling]
    prompts, lengths = PROMPTS + [[3, 3, 3]], [6, 24, 30, 9]
    backend = TorchBackend.from_model(model, 4, max_batch=3, capacity=CAPACITY, min_length=8, shrink_after=1)
    sizes, slots = [], {}

    def watch(scheduler):
        sizes.append((backend.pool.length, backend.pool.width))
        for sequence in scheduler.occupied:
            slots.setdefault(sequence.id, set()).add(sequence.row)

    sequences = _decode(backend, prompts, lengths, params, arrive_every=2, watch=watch)
    assert [s.out for s in sequences] == [reference_generate(model, p, n, params) for p, n in zip(prompts, lengths)]
    assert sum(s.stats.mispredicted for s in sequences) > 0 and sum(s.stats.early_flushes for s in sequences) > 0
    lengths_seen = [length for length, _ in sizes]
    assert lengths_seen[0] < max(lengths_seen) and lengths_seen[-1] < max(lengths_seen)  # grew, then shrank
    assert len({width for _, width in sizes}) > 1 and any(len(held) > 1 for held in slots.values())  # a move


@pytest.mark.parametrize("step", ["speed", "plain"])
def test_bubbles_write_only_the_scratch_row(step):
    """One step with bubbles at positions that hold K/V: the only pool entries that change are the valid
    rows' own (stage layer, slot, sequence, position) rows and the scratch row T no row reads."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)), seed=2)
    backend = TorchBackend.from_model(model, 3, max_batch=2, capacity=32, min_length=32)
    backend.reserve(20, 2)
    gen = torch.Generator().manual_seed(0)
    backend.pool.key.copy_(torch.randn(backend.pool.key.shape, generator=gen))
    backend.pool.value.copy_(torch.randn(backend.pool.value.shape, generator=gen))
    key, value = backend.pool.key.clone(), backend.pool.value.clone()
    expected = torch.zeros(backend.pool.key.shape[:3] + backend.pool.key.shape[4:5], dtype=torch.bool)  # [S, P, W, T+1]
    if step == "speed":
        positions = np.array([[9, 5], [8, 5], [7, 5]])  # [P, n]: sequence 1's bubbles sit on rows sequence 1 holds
        valid = np.array([[True, False], [False, True], [True, False]])
        heads = HeadRows(final=[4], exit=[0], check=[])  # rows s*n + b: slot 2 of sequence 0, its slot 0
        result = backend.speed_step(np.array([7, 0]), positions, valid, heads, want_logits=True)
        assert result.final_tokens.shape == (1,) and result.final_logits.shape == (1, model.cfg.vocab_size)
        assert result.exit_candidates.shape == (1, backend.check_width) and result.check_tokens.shape == (0,)
        for s, b in zip(*np.nonzero(valid)):
            expected[:, s, b, positions[s, b]] = True
    else:
        positions, valid = np.array([9, 5]), np.array([False, True])
        tokens, logits = backend.plain_step(np.array([3, 4]), positions, valid, want_logits=False)
        assert tokens.shape == (2,) and logits is None
        expected[:, :, 1, 5] = True  # every logical layer (stage layer, slot) of sequence 1 at its position
    bubbles = (key != backend.pool.key).any(dim=(3, 5))
    assert torch.equal(bubbles[..., :backend.pool.length], expected[..., :backend.pool.length])
    assert torch.equal((value != backend.pool.value).any(dim=(3, 5))[..., :backend.pool.length], expected[..., :backend.pool.length])


def test_attention_over_the_whole_pool_decodes_the_same(case):
    """full_past (what a captured CUDA graph runs: every step attends over all T+1 rows, masked) gives
    the same ids as attending up to the newest position."""
    name, model, _, _, backends = case
    backend = TorchBackend.from_model(model, backends["torch"].slots, max_batch=3, capacity=CAPACITY)
    backend.executor.full_past = True
    params = SAMPLING["seeded"]
    sequences = _decode(backend, PROMPTS, NEW_TOKENS, params)
    assert [s.out for s in sequences] == [reference_generate(model, p, n, params) for p, n in zip(PROMPTS, NEW_TOKENS)]


def test_speed_step_heads_match_the_onnx_batch_step(case):
    """The same state (K/V written by prefill, hidden carried by a speed step) given to both backends: one
    speed step's final, exit and early-flush check outputs agree with ONNX Runtime's batch step."""
    name, model, _, _, backends = case
    torch_side, onnx_side = backends["torch"], backends["onnx standard"]
    slots, vocab = torch_side.slots, model.cfg.vocab_size
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, vocab, 12)), list(rng.integers(0, vocab, 12))]
    outputs = []
    torch_side.hidden.zero_()  # the first step's slots 1..P-1 read the carried state: the same on both
    onnx_side.hidden[:] = 0
    for backend in (torch_side, onnx_side):
        backend.reserve(CAPACITY, 2)
        backend.prefill(0, prompts, 0, want_logits=False)
        positions = np.array([[12 - s, 11 - s] for s in range(slots)])  # [P, 2]: every slot filled
        valid = np.ones((slots, 2), bool)
        entering = np.array([prompts[0][-1], prompts[1][-2]])
        step_heads = HeadRows(final=[(slots - 1) * 2, (slots - 1) * 2 + 1], exit=[0, 1])
        first = backend.speed_step(entering, positions, valid, step_heads, want_logits=True)
        checks = [s * 2 + b for s in range(1, slots - 1) for b in range(2)]
        # the checks score the top K each token's draft gave, kept by the backend (slot 1: the first step's drafts)
        backend.drafts.ids[1:slots - 1, :2] = np.arange(backend.check_width) * 3 % vocab
        second = backend.speed_step(entering, positions, valid, HeadRows([1], [0, 1], checks), True)
        slot_one = second.check_tokens[:2]  # rows 1*2 + b come first
        assert all(token in drafts for token, drafts in zip(slot_one, first.exit_candidates))
        outputs.append((first, second))
    (torch_first, torch_second), (onnx_first, onnx_second) = outputs
    for mine, theirs in ((torch_first, onnx_first), (torch_second, onnx_second)):
        np.testing.assert_allclose(mine.final_logits, theirs.final_logits, atol=1e-4, rtol=1e-4)
        assert np.array_equal(mine.final_tokens, theirs.final_tokens)
        assert np.array_equal(mine.exit_tokens, theirs.exit_tokens)
        assert np.array_equal(mine.exit_candidates, theirs.exit_candidates)
        assert np.array_equal(mine.check_tokens, theirs.check_tokens)


def test_top_candidates_break_ties_toward_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    assert top_candidates(logits, 4).tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    candidates = torch.tensor([[5, 4, 2], [3, 0, 1]])
    assert best_candidate(logits, candidates).tolist() == [4, 3]  # 4 and 2 tie at 3.0: the first listed


def test_pool_sizes_follow_the_onnx_batch_backend(case):
    """The same reserve calls give the same pool length and width as BatchBackend's rules (grow at once,
    shrink after shrink_after calls), and move carries a sequence's cache rows to its new slot."""
    name, model, art, manifest, backends = case
    mine = TorchBackend.from_model(model, backends["torch"].slots, max_batch=3, capacity=CAPACITY, min_length=4,
                                   shrink_after=2)
    theirs = BatchBackend(art, manifest, 3, CAPACITY, min_length=4, shrink_after=2, fused=False,
                          session=backends["onnx standard"].session)
    for positions, sequences in [(3, 1), (10, 2), (9, 3), (40, 1), (5, 1), (5, 1), (5, 1), (64, 3)]:
        mine.reserve(positions, sequences)
        theirs.reserve(positions, sequences)
        assert (mine.pool.length, mine.pool.width) == (theirs.pool.length, theirs.pool.width)
        assert mine.pool.would_grow(positions + 30, 3) == theirs.pool.would_grow(positions + 30, 3)
    mine.pool.key[:, :, 2] = 1.5
    mine.move(2, 0, 10)
    assert torch.all(mine.pool.key[:, :, 0, :, :10] == 1.5) and not torch.any(mine.pool.key[:, :, 0, :, 10:] == 1.5)
    with pytest.raises(GenerationError, match="exceed the KV-cache row of 64"):
        mine.reserve(65, 1)


@pytest.fixture
def pool_refused_past_64_positions(monkeypatch):
    """A stand-in memory limit: torch refuses any KV-cache pool longer than 64 positions, as CUDA does."""
    real_zeros = torch.zeros

    def zeros(*shape, **kwargs):
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if len(dims) == 6 and dims[4] > 65:  # [S, P, W, kvh, T + 1, hd]
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real_zeros(*shape, **kwargs)

    monkeypatch.setattr(torch_backend.torch, "zeros", zeros)


def test_a_pool_that_cannot_grow_fails_that_request_alone(pool_refused_past_64_positions):
    """reserve past the limit: one-line OutOfMemory, the pool intact; under the scheduler the request
    needing it ends alone with that error while the one beside it decodes to the end."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, context=256)), seed=6)
    backend = TorchBackend.from_model(model, 3, max_batch=2, capacity=256, min_length=16)
    key = backend.pool.key
    with pytest.raises(OutOfMemory) as refused:
        backend.reserve(100, 1)
    assert "\n" not in str(refused.value) and "cannot grow to 104 positions" in str(refused.value)  # within an eighth of 100
    assert backend.pool.key is key and backend.pool.length == 16
    scheduler = BatchScheduler(backend)
    short = scheduler.submit(_request([1, 2, 3], 10, SamplingParams()))
    long = scheduler.submit(_request([4, 5], 120, SamplingParams()))
    scheduler.run()
    assert short.out == reference_generate(model, [1, 2, 3], 10)
    assert long.stats.stop_reason == "error" and isinstance(long.error, OutOfMemory) and not long.out


def test_bad_arguments_are_one_line_errors():
    model = randomize(SharedLlama(random_config(blocks=2, layers=6)), seed=1)
    for kwargs, message in [(dict(capacity=500), "must be 2..128"), (dict(max_batch=0), "at least 1"),
                            (dict(device="meta"), "runs on cpu or cuda"), (dict(device="nonsense"), "use cpu, cuda or cuda:N")]:
        with pytest.raises(SpeedcError, match=message) as error:
            TorchBackend.from_model(model, 3, **kwargs)
        assert "\n" not in str(error.value)
    with pytest.raises(SpeedcError, match="2 slots do not fit"):
        TorchBackend.from_model(model, 2)
    backend = TorchBackend.from_model(model, 3, capacity=32)
    with pytest.raises(GenerationError, match="a row at position 32 in a pool of 32"):  # T is the bubbles' scratch row
        backend.plain_step(np.array([1]), np.array([backend.pool.length]), np.array([True]), False)
    with pytest.raises(SpeedcError, match="CUDA graphs need a CUDA device"):
        TorchBackend.from_model(model, 3, cuda_graphs=True)
    if not torch.cuda.is_available():
        with pytest.raises(SpeedcError, match="CUDA is not available"):
            TorchBackend.from_model(model, 3, device="cuda")


def test_one_slot_decodes_plainly():
    """P = 1 (a plain engine): no speculation, every step a plain one; ids equal the reference's."""
    model = randomize(SharedLlama(random_config(blocks=2, layers=6, heads=4, kv_heads=1)), seed=12)
    backend = TorchBackend.from_model(model, 1, max_batch=3, capacity=CAPACITY)
    assert not backend.speculative and backend.stage_layers == 6
    params = SAMPLING["seeded"]
    sequences = _decode(backend, PROMPTS, NEW_TOKENS, params)
    assert [s.out for s in sequences] == [reference_generate(model, p, n, params) for p, n in zip(PROMPTS, NEW_TOKENS)]
    assert all(s.stats.mode == "batch autoregressive" and s.stats.accepted == 0 for s in sequences)


@pytest.mark.parametrize("slots, shape", [(3, dict(blocks=2, layers=6, heads=4, kv_heads=2, hidden=64)),
                                          (4, dict(blocks=2, layers=8, heads=4, kv_heads=1, tie=False))])
def test_exact_speed_logits_are_bitwise_plain_logits(slots, shape, sampled_logits):
    """exact=True: every logits row SPEED samples from is bitwise plain decoding's row for that position
    (torch's 1-row and P-row products differ in the last bits otherwise), one sequence; three sequences
    at once give the reference's ids in both modes."""
    seen, decoding_as = sampled_logits
    model = randomize(SharedLlama(random_config(**shape)), seed=21)
    backend = TorchBackend.from_model(model, slots, max_batch=3, capacity=CAPACITY, exact=True)
    params = SAMPLING["seeded"]
    for mode, speculate in (("speed", True), ("plain", False)):
        decoding_as(mode)
        _decode(backend, PROMPTS[:1], [40], params, speculate=speculate)
    assert seen["speed"].keys() == seen["plain"].keys() and len(seen["speed"]) == 40
    for position, row in seen["speed"].items():
        assert np.array_equal(row, seen["plain"][position]), position
    expected = [reference_generate(model, p, n, params) for p, n in zip(PROMPTS, NEW_TOKENS)]
    for speculate in (True, False):
        assert [s.out for s in _decode(backend, PROMPTS, NEW_TOKENS, params, speculate=speculate)] == expected
