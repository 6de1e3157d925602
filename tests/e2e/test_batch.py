"""Continuous batching on the zoo model: generate_batch, the asyncio engine loop (streaming, cancel),
the KV-cache pool limits, old artifacts, and `speedc generate --prompts-file`. Losslessness over random
models with forced mispredictions is the property test in tests/numeric/test_properties.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import assert_one_line_error, run_cli
from speedc import Engine
from speedc.format import contract
from speedc.format.artifact import read_manifest
from speedc.errors import ArtifactError, GenerationError
from speedc.runtimes.acceptance_policy import AlwaysSpeculate
from speedc.runtimes.backends.onnx import BatchBackend
from speedc.runtimes.backends.protocol import HeadRows
from speedc.runtimes.engine_loop import EngineLoop

PROMPTS = ["ROMEO:", "JULIET: O", "KING HENRY:", "First Citizen:\nBefore"]
SETTINGS = [{}, {"temperature": 0.8, "seed": 3}, {"stop": ["\n"]}, {"temperature": 1.1, "top_k": 20, "seed": 9, "stop": ["the"]}]


@pytest.fixture(scope="module")
def engine(tiny_artifact) -> Engine:
    return Engine.load(tiny_artifact)


def _alone(engine: Engine, prompt: str, settings: dict, max_new_tokens: int = 24):
    return engine.generate(prompt, max_new_tokens=max_new_tokens, mode="autoregressive", **settings)


def test_generate_batch_equals_each_prompt_alone(engine):
    """Two slots for four prompts (two wait), stop strings, EOS, seeded sampling: ids, text and the stop
    reason of each equal plain decoding of that prompt alone."""
    results = engine.generate_batch(PROMPTS, max_new_tokens=24, settings=SETTINGS, max_batch=2)
    reasons = set()
    for prompt, settings, result in zip(PROMPTS, SETTINGS, results):
        plain = _alone(engine, prompt, settings)
        assert (result.ids, result.text, result.stats.stop_reason) == (plain.ids, plain.text, plain.stats.stop_reason)
        reasons.add(result.stats.stop_reason)
    assert reasons >= {"stop_string", "max_new_tokens"}
    assert sum(r.stats.accepted for r in results) > 0  # the batch really speculated
    assert {r.stats.mode for r in results} == {"batch speed"}
    plain = engine.generate_batch(PROMPTS[:2], max_new_tokens=8, row_budget=0, max_batch=2)
    assert {r.stats.mode for r in plain} == {"batch autoregressive"}  # was "batch speed" with no step speculating
    assert [r.ids for r in plain] == [_alone(engine, p, {}, 8).ids for p in PROMPTS[:2]]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "standard"])
def test_prompts_arriving_together_prefill_in_padded_runs(engine, fused):
    """Prompts of 5, 7, 6, 11, 1 and ~40 tokens arrive at once (prefill_chunk 32): first chunks batch,
    right padded, while sequences x longest first chunk stays within 32 tokens: [5, 7, 6] (3 x 7), [11, 1]
    (2 x 11), the long prompt's first chunk alone (32), its rest alone (past context): 4 runs, not 7.
    Greedy and seeded sampling: each sequence equals plain decoding of it alone."""
    prompts = PROMPTS[:2] + [PROMPTS[2], PROMPTS[3], "O", "To be, or not to be, that is the question: " * 3]
    lengths = [len(engine.request_from(p, {}).prompt) for p in prompts]
    assert lengths[:5] == [5, 7, 6, 11, 1] and 32 < lengths[5] <= 64  # the grouping below depends on them
    settings = [{}, {"temperature": 0.8, "seed": 3}, {}, {"temperature": 1.1, "top_k": 20, "seed": 9}, {}, {}]
    scheduler = engine.batch_scheduler(max_batch=6, fused=fused, prefill_chunk=32)
    results = engine.generate_batch(prompts, max_new_tokens=10, stop_at_eos=False, settings=settings, scheduler=scheduler)
    assert scheduler.steps["prefill"] == 4
    for prompt, setting, result in zip(prompts, settings, results):
        assert result.ids == _alone(engine, prompt, {"stop_at_eos": False, **setting}, 10).ids


def test_engine_loop_streams_confirmed_pieces_and_cancels(engine):
    async def scenario():
        loop = EngineLoop(engine, max_batch=2)
        first = loop.submit(PROMPTS[0], max_new_tokens=24)
        second = loop.submit(PROMPTS[1], max_new_tokens=24, temperature=0.8, seed=3)
        doomed = loop.submit(PROMPTS[2], max_new_tokens=24)
        pieces = []
        async for piece in first:
            pieces.append(piece)
            if len(pieces) == 3:
                loop.cancel(second)
        third = await doomed.wait()
        await second.wait()
        late = loop.submit(PROMPTS[3], max_new_tokens=8, **SETTINGS[3])  # after the loop went idle
        await late.wait()
        await loop.aclose()
        return first, pieces, second, third, late

    first, pieces, second, third, late = asyncio.run(scenario())
    assert [i for p in pieces for i in p.ids] == first.result.ids == _alone(engine, PROMPTS[0], {}).ids
    assert all(len(p.ids) <= 1 for p in pieces)  # one confirmed token a piece (none: held-back text)
    assert "".join(p.text for p in pieces) == first.result.text and first.finish_reason == "max_new_tokens"
    assert second.finish_reason == "cancelled"
    assert second.result.ids == _alone(engine, PROMPTS[1], SETTINGS[1]).ids[:len(second.result.ids)]
    assert third.ids == _alone(engine, PROMPTS[2], {}).ids
    assert late.result.ids == _alone(engine, PROMPTS[3], SETTINGS[3], max_new_tokens=8).ids


def test_engine_loop_holds_back_text_that_may_begin_a_stop_string(engine):
    """A stop string made of two tokens' text: the first token's text may begin it, so no stream shows
    it before the second decides (the old batched stream showed it, then the stop cut it: a leak)."""
    plain = _alone(engine, PROMPTS[0], {}, 24)
    stop = None
    for i in range(1, len(plain.ids) - 1):
        before, first, both = (engine.decode_text(plain.ids[:n]) for n in (i, i + 1, i + 2))
        head, stop = first[len(before):], both[len(before):]
        if head and both.startswith(first) and len(stop) > len(head) and plain.text.find(stop) == len(before):
            break
    else:
        pytest.fail("no two-token stop string in the plain output")

    async def scenario():
        loop = EngineLoop(engine, max_batch=2)
        submitted = loop.submit(PROMPTS[0], max_new_tokens=24, stop=[stop])
        pieces = [piece.text async for piece in submitted]
        await loop.aclose()
        return pieces, submitted.result

    pieces, result = asyncio.run(scenario())
    assert result.text == before == _alone(engine, PROMPTS[0], {"stop": [stop]}).text
    assert "".join(pieces) == before and result.stats.stop_reason == "stop_string"
    assert "".join(engine.stream(PROMPTS[0], max_new_tokens=24, stop=[stop])) == before  # the same rule


def test_one_session_serves_single_and_batched_calls(tiny_artifact, engine):
    """Engine.load(lazy=True) opens its backend on first use, once; batching then runs a pool of its own
    on the engine's session (its graph opened once per process)."""
    lazy = Engine.load(tiny_artifact, lazy=True)
    assert not lazy.backend_loaded
    batched = lazy.generate_batch(PROMPTS[:2], max_new_tokens=8, max_batch=2)
    assert lazy.backend_loaded
    scheduler = lazy.batch_scheduler(max_batch=2)
    assert scheduler.backend is not lazy.backend and scheduler.backend.session is lazy.backend.session
    assert lazy.generate(PROMPTS[0], max_new_tokens=8).ids == batched[0].ids == _alone(engine, PROMPTS[0], {}, 8).ids
    other = lazy.batch_scheduler(max_batch=2, fused=not lazy.backend.fused)  # another graph: its own session
    assert other.backend.session is not lazy.backend.session


def test_pool_limits_are_refused_in_one_line_not_truncated(engine):
    scheduler = engine.batch_scheduler(max_batch=2, kv_cache_mb=0.1)
    capacity = scheduler.backend.pool.capacity
    assert capacity < engine.manifest.model["max_context"]
    with pytest.raises(GenerationError, match="exceeds the KV-cache row"):
        scheduler.submit(engine.request_from([1, 2, 3], dict(max_new_tokens=capacity)))
    with pytest.raises(GenerationError, match="leaves no room"):
        engine.batch_scheduler(max_batch=8, kv_cache_mb=0.001)
    with pytest.raises(GenerationError, match="unknown generation setting"):
        engine.generate_batch(["a"], settings=[{"temprature": 1.0}])
    empty = engine.request_from([1], dict(max_new_tokens=4))
    empty.prompt = []  # the scheduler's own API (Engine.encode refuses empty text before it gets here)
    with pytest.raises(GenerationError, match="empty prompt"):
        scheduler.submit(empty)
    assert not scheduler.busy


def test_pool_length_follows_the_longest_request_losslessly(engine):
    """The pool's length T follows the longest request in it (BatchBackend.reserve): a long request
    joining a short one mid-decode grows it (the short one's K/V copied over), and once only a short one
    is left it shrinks back (keeping that one's K/V); each sequence equals plain decoding of it alone."""
    from speedc.runtimes.batch import BatchScheduler

    backend = BatchBackend(engine.directory, engine.manifest, max_batch=2, capacity=engine.manifest.model["max_context"],
                           min_length=16, shrink_after=4)
    scheduler = BatchScheduler(backend)

    def submit(prompt: str, max_new_tokens: int):
        return scheduler.submit(engine.request_from(prompt, dict(max_new_tokens=max_new_tokens, stop_at_eos=False)))

    short, long, late = submit(PROMPTS[0], 20), None, None
    lengths = []
    while scheduler.busy or late is None:
        if long is None and len(short.out) >= 5:
            long = submit(PROMPTS[1], 200)
        if late is None and long is not None and len(long.out) >= 185:
            late = submit(PROMPTS[2], 24)
        scheduler.step()
        if not lengths or lengths[-1] != backend.pool.length:
            lengths.append(backend.pool.length)
    from speedc.runtimes.backends.kv_pool import pool_length

    needs = [len(engine.encode(prompt)) + new for prompt, new in ((PROMPTS[0], 20), (PROMPTS[1], 200), (PROMPTS[2], 24))]
    assert lengths == [pool_length(need, 16, backend.pool.capacity) for need in needs] and lengths[0] < lengths[1] > lengths[2]
    for sequence, prompt, new in ((short, PROMPTS[0], 20), (long, PROMPTS[1], 200), (late, PROMPTS[2], 24)):
        assert sequence.out == _alone(engine, prompt, {}, new).ids


def test_pool_width_follows_the_occupied_slots_losslessly(engine):
    """The pool's width W (pool rows its attention runs over) follows the occupied slots: one
    request in a pool of 4 runs alone (W = 1, no padding rows), two joining it mid-decode grow W to 4
    (the first one's K/V copied over), and a few steps after they leave W shrinks back to 1 (keeping the
    first one's K/V); each sequence equals plain decoding of it alone."""
    from speedc.runtimes.batch import BatchScheduler

    backend = BatchBackend(engine.directory, engine.manifest, max_batch=4, capacity=engine.manifest.model["max_context"],
                           shrink_after=4)
    scheduler = BatchScheduler(backend)

    def submit(prompt: str, max_new_tokens: int):
        return scheduler.submit(engine.request_from(prompt, dict(max_new_tokens=max_new_tokens, stop_at_eos=False)))

    first, others = submit(PROMPTS[0], 40), []
    widths = []
    while scheduler.busy:
        if not others and len(first.out) >= 5:
            others = [submit(PROMPTS[1], 10), submit(PROMPTS[2], 12)]
        scheduler.step()
        if not widths or widths[-1] != backend.pool.width:
            widths.append(backend.pool.width)
    assert widths[0] == 1 and max(widths) == 4 and widths[-1] == 1  # 4 -> 2 -> 1 or 4 -> 1 as the two leave
    for sequence, prompt, new in ((first, PROMPTS[0], 40), (others[0], PROMPTS[1], 10), (others[1], PROMPTS[2], 12)):
        assert sequence.out == _alone(engine, prompt, {}, new).ids


def test_artifact_without_engine_graph_asks_for_a_rebuild(tiny_artifact):
    manifest = read_manifest(tiny_artifact)
    del manifest.graphs[contract.fused(contract.ENGINE)]  # the standard engine graph serves then
    assert not BatchBackend(tiny_artifact, manifest, max_batch=1, capacity=8).fused
    del manifest.graphs[contract.ENGINE]
    with pytest.raises(ArtifactError, match="no engine graph; rebuild"):
        BatchBackend(tiny_artifact, manifest, max_batch=1, capacity=8)


def test_cli_prompts_file_json_in_input_order(engine, tiny_artifact, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    result = run_cli("generate", tiny_artifact, "--prompts-file", prompts, "--json", "--max-new-tokens", "12",
                     "--max-batch", "2", "--seed", "4", "--temperature", "0.7")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["ids"] for r in rows] == [_alone(engine, p, {"temperature": 0.7, "seed": 4}, 12).ids for p in PROMPTS[:3]]
    assert all(r["stats"]["mode"] == "batch speed" and r["text"] and r["products"] == "ONNX Runtime" for r in rows)
    prompts.write_text("a\n\nb\n")
    assert_one_line_error(run_cli("generate", tiny_artifact, "--prompts-file", prompts), "line 2 is empty")
    prompts.write_text("a\n  \n")  # spaces are a prompt, as with --prompt "  " (they were refused as empty)
    result = run_cli("generate", tiny_artifact, "--prompts-file", prompts, "--json", "--max-new-tokens", "6")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["ids"] for line in result.stdout.splitlines()] == [
        _alone(engine, p, {}, 6).ids for p in ("a", "  ")]


def test_cli_prompts_file_lines_are_what_wc_counts_and_plain_output_is_one_line_each(engine, tiny_artifact, tmp_path):
    """Before: splitlines() split a prompt at a form feed or U+2028, a byte-order mark became part of the
    first prompt, and plain output printed each completion's newlines raw, so its lines could not be
    told apart. Now lines end at \\n or \\r\\n only, the mark is dropped, "-" reads stdin, and plain output
    is one line per prompt (newlines escaped as \\n). Outputs equal each prompt alone."""
    lines = ["ROMEO:", "JULIET:\fO\u2028sweet"]
    text = "\ufeff" + lines[0] + "\r\n" + lines[1] + "\n"
    result = run_cli("generate", tiny_artifact, "--prompts-file", "-", "--max-new-tokens", "24", stdin=text)
    assert result.returncode == 0, result.stderr
    expected = [_alone(engine, line, {}, 24).text for line in lines]
    assert any("\n" in t for t in expected)  # the escaping is exercised
    assert result.stdout.split("\n")[:-1] == [t.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
                                              for t in expected]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\n" + "x " * 600 + "\n")
    assert_one_line_error(run_cli("generate", tiny_artifact, "--prompts-file", prompts), "prompt 2: prompt (", "context")
    assert_one_line_error(run_cli("generate", tiny_artifact, "--prompts-file", prompts, "--backend", "torch"),
                          "continuous batching runs on ONNX Runtime on the CPU, not --backend torch")


def test_per_sequence_decisions_turn_the_batch_plain_and_back_losslessly(engine):
    """The real acceptance rule with quick knobs on zoo:tiny: greedy sequences (high acceptance) want to
    speculate, hot-sampled ones (low acceptance) fall back, probe and fall back again; the batch runs
    speed and plain steps as their sum decides, and every sequence equals plain decoding of it alone."""
    from speedc.runtimes.acceptance_policy import AcceptancePolicy
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy
    from speedc.runtimes.backends.onnx import make_batch_backend
    from speedc.runtimes.step_costs import StepCosts

    policy = AcceptancePolicy(engine.manifest.slots, step_cost=1.6, min_outcomes=2, probe_after=3, confidence=0.0)
    backend = make_batch_backend(engine.directory, engine.manifest, max_batch=3, capacity=80)
    scripted = StepCosts(engine.manifest.slots, 1.6, "scripted", measuring=False)  # the rule's logic, not this host's c(P)
    scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=None), acceptance=policy, prefill_chunk=8,
                               costs=scripted)
    settings = [{}, {"temperature": 1.2, "seed": 3}, {"temperature": 1.5, "top_k": 50, "seed": 9}, {}]
    sequences = [scheduler.submit(engine.request_from(p, dict(max_new_tokens=32, stop_at_eos=False, **s)), early_flush=i % 2 == 0)
                 for i, (p, s) in enumerate(zip(PROMPTS, settings))]
    scheduler.run()
    for prompt, setting, sequence in zip(PROMPTS, settings, sequences):
        assert sequence.out == _alone(engine, prompt, {"stop_at_eos": False, **setting}, 32).ids
    assert scheduler.steps["speed"] > 0 and scheduler.steps["plain"] > 0 and scheduler.mode_switches >= 2
    assert sequences[0].acceptance.fallbacks == 0 and sequences[1].acceptance.fallbacks >= 2  # fell back, probed, fell back


def test_a_verdict_far_from_changing_stands_for_a_few_steps(engine):
    """Greedy zoo:tiny at a cheap scripted c: the bound sits far above 1, so the policy decides at every
    DECISION_REUSE-th step only (its work between two runs slows the next run too); at a c where speculation
    loses it decides at every step. The tokens are plain decoding's either way."""
    from speedc.runtimes.acceptance_policy import AcceptancePolicy
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import DECISION_REUSE, RowPolicy
    from speedc.runtimes.step_costs import StepCosts

    class CountingCosts(StepCosts):
        decisions = 0

        def step_cost(self, sequences, length, kind="speed", depth=None):
            self.decisions += depth in (None, self.slots)  # asked once per depth at each decision
            return super().step_cost(sequences, length, kind, depth)

    slots = engine.manifest.slots
    for cost, far in ((1.2, True), (3.9, False)):
        costs = CountingCosts(slots, cost, "scripted", measuring=False)
        scheduler = BatchScheduler(engine.backend, policy=RowPolicy(row_budget=None), prefill_chunk=64, costs=costs,
                                   acceptance=AcceptancePolicy(slots, cost, "scripted"))
        sequence = scheduler.submit(engine.request_from(PROMPTS[0], dict(max_new_tokens=40, stop_at_eos=False)))
        scheduler.run()
        assert sequence.out == _alone(engine, PROMPTS[0], {"stop_at_eos": False}, 40).ids
        steps = sum(scheduler.decode_steps.values())
        if far:
            assert sequence.stats.fallbacks == 0 and costs.decisions <= steps // DECISION_REUSE + 2
        else:
            assert sequence.stats.fallbacks >= 1 and costs.decisions == steps


class ScriptedAcceptance(AlwaysSpeculate):
    """A stand-in for the acceptance rule that says plain decoding for the batch decisions in PLAIN_CALLS."""

    def __init__(self, plain_calls: range) -> None:
        self.plain_calls, self.calls = plain_calls, 0

    def batch_speculates(self, states, speculating: bool = True, cost: float | None = None,
                         depth: int | None = None) -> bool:
        self.calls += 1
        return self.calls not in self.plain_calls


def test_a_batch_the_acceptance_rule_turned_plain_speculates_again_at_the_row_budget(engine):
    """Two sequences at P = 4 fill a row budget of 8 exactly (its resume mark: 6 rows). The acceptance rule
    (scripted) says plain for decisions 4-8, then speculate: the batch must speculate again, though its
    rows sit above the row rule's resume mark (each rule's hysteresis follows its own verdict); it had
    stayed plain to the end. Both equal plain decoding alone."""
    from speedc.runtimes.batch import BatchScheduler
    from speedc.runtimes.speculation import RowPolicy
    from speedc.runtimes.backends.onnx import make_batch_backend

    backend = make_batch_backend(engine.directory, engine.manifest, max_batch=2, capacity=64)
    scheduler = BatchScheduler(backend, policy=RowPolicy(row_budget=2 * engine.manifest.slots),
                               acceptance=ScriptedAcceptance(range(4, 9)))
    sequences = [scheduler.submit(engine.request_from(p, dict(max_new_tokens=32, stop_at_eos=False))) for p in PROMPTS[:2]]
    scheduler.run()
    assert scheduler.steps["plain"] >= 5 and scheduler.mode_switches == 2  # speed -> plain -> speed
    assert scheduler.steps["speed"] > 10
    for prompt, sequence in zip(PROMPTS, sequences):
        assert sequence.out == _alone(engine, prompt, {"stop_at_eos": False}, 32).ids


def test_pool_shrink_that_cannot_allocate_keeps_the_pool_and_fused_rows_stay_inside_it(engine, monkeypatch):
    """A shrink is best effort: when its new buffers cannot be allocated (forced here) the pool in place,
    which holds what is needed, stays. A fused step never runs a row past the pool's scratch row T (the
    graph writes K/V in place through raw pointers): it is refused in one line instead."""
    import numpy as np

    from speedc.runtimes.backends import onnx as batch_backend

    backend = BatchBackend(engine.directory, engine.manifest, max_batch=2, capacity=512, shrink_after=1)
    backend.reserve(300, 2)
    assert (backend.pool.width, backend.pool.length) == (2, 320)  # 300 positions: 5 x 64
    pool = backend.pool.key

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(batch_backend.np, "zeros", no_memory)
    backend.reserve(10, 1)
    monkeypatch.undo()
    assert backend.pool.key is pool and (backend.pool.width, backend.pool.length) == (2, 320)
    if backend.fused:
        positions = np.full((backend.slots, 1), backend.pool.length + 1, np.int64)
        with pytest.raises(GenerationError, match="internal: a row at position"):
            backend.speed_step(np.zeros(1, np.int64), positions, np.ones((backend.slots, 1), bool), HeadRows(exit=[0]), False)


def test_candidate_checks_keep_early_flush_lossless(engine):
    """Early-flush checks score only the top 8 ids of their token's draft (the one kind of check since
    the whole-vocabulary step_flush graph went: they flushed at the very same steps on zoo:small, 605
    early flushes of 605 over 25 runs of 128 tokens). On zoo:tiny, early flush changes no id (alone
    and four at once, against early flush off and plain decoding), really flushes, and each prompt's
    early flushes, accepted and failed speculations are the same alone and in a batch of four."""
    checks = []
    alone = {p: engine.generate(p, max_new_tokens=48, stop_at_eos=False, mode="speed-always", early_flush=True)
             for p in PROMPTS}
    assert sum(r.stats.early_flushes for r in alone.values()) > 0  # else equal counts would prove nothing
    for prompt, result in alone.items():
        assert result.ids == engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode="speed-always",
                                             early_flush=False).ids
        assert result.ids == engine.generate(prompt, max_new_tokens=48, stop_at_eos=False, mode="autoregressive").ids

    def outcomes(result):
        return result.ids, result.stats.early_flushes, result.stats.accepted, result.stats.mispredicted

    for max_batch in (1, 4):
        scheduler = engine.batch_scheduler(max_batch=max_batch, row_budget=None, per_sequence=False)
        speed_step = scheduler.backend.speed_step

        def counting(entering, positions, valid, heads, want, speed_step=speed_step):
            checks.append(len(heads.check))
            return speed_step(entering, positions, valid, heads, want)

        scheduler.backend.speed_step = counting
        batched = engine.generate_batch(PROMPTS, max_new_tokens=48, stop_at_eos=False, scheduler=scheduler)
        for prompt, result in zip(PROMPTS, batched):
            assert outcomes(result) == outcomes(alone[prompt]), (max_batch, prompt)
    assert sum(checks) > len(checks)  # about two checks a step per sequence once the pipelines are full


def test_prefill_takes_turns_so_a_long_prompt_never_holds_a_later_first_token(engine):
    """Before: the sequence in the lowest pool row took every prefill chunk until its prompt was in, so a new
    request waited behind a long prompt, and behind a prompt whose log-probabilities are asked (a token a run:
    ~190 runs here). Now prefill chunks go round the prefilling sequences in order of arrival: the later short
    request has its first token within a few iterations. Both outputs (and the prompt's log-probabilities)
    equal each alone."""
    text = "To be, or not to be, that is the question: " * 12
    scheduler = engine.batch_scheduler(max_batch=2, prefill_chunk=32)
    echo = scheduler.submit(engine.request_from(text, dict(max_new_tokens=4, prompt_logprobs=1, stop_at_eos=False)))
    scheduler.step()
    later = scheduler.submit(engine.request_from(PROMPTS[0], dict(max_new_tokens=4, stop_at_eos=False)))
    iterations = 0
    while not later.out:
        scheduler.step()
        iterations += 1
    assert iterations <= 3 and echo.prefilled < len(echo.request.prompt) // 2 and len(echo.request.prompt) > 150
    scheduler.run()
    alone = engine.batch_scheduler(max_batch=1, prefill_chunk=32)
    echo_alone = alone.submit(engine.request_from(text, dict(max_new_tokens=4, prompt_logprobs=1, stop_at_eos=False)))
    alone.run()
    assert echo.out == echo_alone.out and later.out == _alone(engine, PROMPTS[0], {"stop_at_eos": False}, 4).ids
    assert [(e.token, e.logprob) for e in echo.request.prompt_logprob_values] == \
        [(e.token, e.logprob) for e in echo_alone.request.prompt_logprob_values]
