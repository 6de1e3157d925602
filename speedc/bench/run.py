"""`speedc bench`: SPEED against plain decoding on the same artifact and backend, measured in one
run, interleaved (A B A B ...), so machine noise hits both sides alike. Reports medians and spread,
and refuses to print a speed before checking that both modes produced identical ids.

With --peers (the default when torch and transformers are installed) the peer systems (speedc.bench.peers)
run in the same interleaved loop, timed end to end. A peer on the same weights must produce SPEED's ids
(a difference refuses the report); a peer at another precision (ORT GenAI int4, or any fp32 peer on a
block-quantized artifact) is compared instead: peer_agreement reports, pooled over all runs,
  agreement         share of new tokens equal to SPEED's at the same position
  prefix_agreement  share of new tokens before the run's first difference (greedy paths part there)

Also measures the step cost c(P) = (time of one P-slot step) / (time of one plain token / P), i.e.
a full step against the single-slot stage passes plain decoding does per token, and compares the
achieved speedup with the analytic bound P / (c(P) (1 + (1 - alpha)(P - 1))) of speedc.cost_model.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from speedc.errors import SpeedcError
from speedc.runtimes.decode import pooled_acceptance
from speedc.runtimes.engine import Engine
from speedc.runtimes.speculation import MODES
from speedc.cost_model import analytic_bound
from speedc.step_timer import measure_step_cost

DEFAULT_PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed any further, hear me speak.\n", "KING HENRY:\n",
                   "To be, or not to be, that is the question:\n", "JULIET:\nO Romeo, Romeo!"]


@dataclass
class BenchReport:
    artifact: str
    backend: str
    slots: int
    new_tokens: int
    repeats: int
    identical_ids: bool
    # mode -> {p50, p90, min} of decode ms/token (prefill excluded): speed (the default: speculating while it
    # pays here), speed-always (speculating at every step), autoregressive
    ms_per_token: dict[str, dict[str, float]]
    tokens_per_second: dict[str, float]  # decode only, from the p50
    speedup_p50: float  # decode only (prefill excluded): autoregressive p50 / speed p50 of ms_per_token
    # acceptance, flushes and tokens per step: of the speed-always runs (SPEED's speculation itself; the
    # default mode speculates only while it pays)
    acceptance_rate: float  # speculations confirmed / checked (failures at the last layer or by early flush)
    tokens_per_step: float
    early_flush: bool
    flushes: dict[str, int]  # SPEED runs, summed: flushes at the last layer / by early flush; tokens discarded
    step_cost: float  # c(P)
    bound: float
    achieved_over_bound: float
    prefill_ms_p50: float
    e2e_ms_per_token: dict[str, dict[str, float]]  # system -> percentiles of (wall time of the call / new tokens)
    speed_speedup_e2e: dict[str, float]  # end to end (prefill + decode): system -> its p50 e2e ms/token / SPEED's
    weight_bytes: dict[str, int] = field(default_factory=dict)  # what each system stores
    peak_rss_mb: dict[str, float] = field(default_factory=dict)  # system -> peak RSS of a fresh process running it
    # peer -> {same_weights, identical_ids, agreement, prefix_agreement} (module docstring)
    peer_agreement: dict[str, dict] = field(default_factory=dict)
    speedup_always_p50: float = 0.0  # autoregressive p50 / speed-always p50 (decode only)
    policy: dict = field(default_factory=dict)  # the default mode's decisions, summed over its runs, and its costs
    sweep: dict[str, dict] = field(default_factory=dict)  # "slots" / "length" -> {rows, skipped}
    notes: list[str] = field(default_factory=list)

    @property
    def speedup_decode_p50(self) -> float:
        """SPEED over plain decoding, decode only (prefill excluded): the same figure as speedup_p50."""
        return self.speedup_p50

    @property
    def speedup_e2e_p50(self) -> float:
        """SPEED over plain decoding, end to end (prefill + decode)."""
        return self.speed_speedup_e2e["autoregressive"]

    def to_json(self) -> dict:
        """The fields, plus speedup_decode_p50 and speedup_e2e_p50 (each speedup named for what it measures)."""
        return {**self.__dict__, "speedup_decode_p50": self.speedup_decode_p50, "speedup_e2e_p50": self.speedup_e2e_p50}


@dataclass
class Agreement:
    """One peer's ids against SPEED's, pooled over runs (SPEED's length is the count of positions)."""
    same_weights: bool
    runs: int = 0
    identical_runs: int = 0
    equal_tokens: int = 0  # positions where the peer's token equals SPEED's
    prefix_tokens: int = 0  # positions before the run's first difference
    tokens: int = 0

    def add(self, peer_ids: list[int], speed_ids: list[int]) -> None:
        equal = [i < len(peer_ids) and peer_ids[i] == token for i, token in enumerate(speed_ids)]
        self.runs += 1
        self.identical_runs += peer_ids == speed_ids
        self.equal_tokens += sum(equal)
        self.prefix_tokens += equal.index(False) if False in equal else len(equal)
        self.tokens += len(speed_ids)

    def to_json(self) -> dict:
        return {"same_weights": self.same_weights, "identical_ids": self.identical_runs == self.runs,
                "agreement": round(self.equal_tokens / max(self.tokens, 1), 4),
                "prefix_agreement": round(self.prefix_tokens / max(self.tokens, 1), 4)}


def _percentiles(samples: list[float]) -> dict[str, float]:
    arr = np.asarray(samples)
    return {"p50": round(float(np.percentile(arr, 50)), 4), "p90": round(float(np.percentile(arr, 90)), 4),
            "min": round(float(arr.min()), 4)}


def warm_up(engine: Engine, prompt, modes, new_tokens: int) -> None:
    """One untimed run of each mode as long as a timed one: ONNX Runtime's first runs of a graph at each pool
    length the cache grows through are slow, and would count against whichever mode meets that length first
    (measured on zoo:small at 1,024 positions: the first timed run at 0.85x plain, later ones 0.96-1.08x).
    The default mode's engine also learns here what its later requests start from, as a serving engine has."""
    for mode in modes:
        engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode=mode)


def mode_order(modes: tuple, turn: int) -> tuple:
    """MODES in the order of round TURN: every order in turn, so each mode runs first equally often and after
    each other mode equally often. A run slows the one after it when that runs another mode (measured on
    zoo:small: a SPEED run 2-8% slower after a plain run than after a SPEED run)."""
    orders = list(itertools.permutations(modes))
    return orders[turn % len(orders)]


def run_bench(engine: Engine, *, prompts: list[str] | None = None, new_tokens: int = 128, repeats: int = 3,
              early_flush: bool | None = None, peers: dict | None = None) -> BenchReport:
    """Interleave, per prompt: speed, speed-always, autoregressive (in every order in turn: mode_order), then each
    peer (name -> LoadedPeer of speedc.bench.peers: generate, must_match). The other modes' ids and those of
    every must_match peer must equal SPEED's (else SpeedcError, no report); the others' agreement is measured."""
    prompts = prompts or DEFAULT_PROMPTS
    peers = peers or {}
    agreement = {name: Agreement(same_weights=peer.must_match) for name, peer in peers.items()}
    modes = tuple(MODES)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    e2e: dict[str, list[float]] = {name: [] for name in (*modes, *peers)}
    prefill: list[float] = []
    speed_runs, adaptive_runs, steps, emitted = [], [], 0, 0
    flushes = {"last_layer": 0, "early": 0, "tokens_discarded": 0}
    identical = True
    warm_up(engine, prompts[0], modes, new_tokens)
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            results = {}
            for mode in mode_order(modes, repeat * len(prompts) + index):
                start = time.perf_counter()
                result = engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, mode=mode,
                                         early_flush=early_flush)
                e2e[mode].append(1000 * (time.perf_counter() - start) / new_tokens)
                results[mode] = result
                times[mode].append(1000 * result.stats.decode_seconds / max(result.stats.new_tokens - 1, 1))
                prefill.append(1000 * result.stats.prefill_seconds)
            identical &= results["speed"].ids == results["speed-always"].ids == results["autoregressive"].ids
            run_peers(peers, engine.encode(prompt), new_tokens, results["speed"].ids, e2e, agreement)
            s = results["speed-always"].stats
            speed_runs.append(s)
            adaptive_runs.append(results["speed"].stats)
            steps, emitted = steps + s.steps, emitted + s.new_tokens - 1
            for key, count in (("last_layer", s.mispredicted), ("early", s.early_flushes), ("tokens_discarded", s.flushed_tokens)):
                flushes[key] += count
    if not identical:
        raise SpeedcError("speed and autoregressive outputs differ: refusing to report speeds (this is a bug)")
    alpha = pooled_acceptance(speed_runs)
    slots = engine.manifest.slots
    longest = max(len(engine.encode(p)) for p in prompts)
    cost = measure_step_cost(engine, context=longest + new_tokens)
    bound = analytic_bound(slots, alpha, cost)
    ms = {mode: _percentiles(samples) for mode, samples in times.items()}
    speedup = ms["autoregressive"]["p50"] / ms["speed"]["p50"]
    e2e_ms = {name: _percentiles(samples) for name, samples in e2e.items()}
    return BenchReport(
        artifact=str(engine.directory), backend=engine.backend_name, slots=slots, new_tokens=new_tokens,
        repeats=repeats * len(prompts), identical_ids=identical, ms_per_token=ms,
        early_flush=engine.early_flush_default if early_flush is None else early_flush,
        tokens_per_second={mode: round(1000 / v["p50"], 1) for mode, v in ms.items()},
        speedup_p50=round(speedup, 3), acceptance_rate=round(alpha, 4), flushes=flushes, tokens_per_step=round(emitted / max(steps, 1), 4),
        step_cost=round(cost, 3), bound=round(bound, 3), achieved_over_bound=round(speedup / bound, 3),
        prefill_ms_p50=round(statistics.median(prefill), 3), e2e_ms_per_token=e2e_ms,
        speed_speedup_e2e={name: round(v["p50"] / e2e_ms["speed"]["p50"], 3) for name, v in e2e_ms.items() if name != "speed"},
        peer_agreement={name: a.to_json() for name, a in agreement.items()},
        speedup_always_p50=round(ms["autoregressive"]["p50"] / ms["speed-always"]["p50"], 3),
        policy=policy_summary(adaptive_runs))


def run_peers(peers: dict, ids: list[int], new_tokens: int, speed_ids: list[int], e2e: dict, agreement: dict) -> None:
    """Each peer on the prompt IDS: its time per token into E2E, its agreement with SPEED's ids (SPEED_IDS) into
    AGREEMENT; a peer that runs the artifact's weights (must_match) and differs is an error."""
    for name, peer in peers.items():
        start = time.perf_counter()
        peer_ids = peer.generate(ids, new_tokens)
        e2e[name].append(1000 * (time.perf_counter() - start) / new_tokens)
        if peer.must_match and peer_ids != speed_ids:
            raise SpeedcError(f"{name} runs the artifact's weights but produced different ids than SPEED: "
                              "refusing to report speeds")
        agreement[name].add(peer_ids, speed_ids)


def policy_summary(runs) -> dict:
    """The default mode's decisions summed over RUNS (DecodeStats), and the last run's cost, bound and what the
    runtime measured on this host."""
    last = runs[-1]
    depth_steps: dict[int, int] = {}
    for stats in runs:
        for depth, steps in stats.depth_steps.items():
            depth_steps[depth] = depth_steps.get(depth, 0) + steps
    return {**{key: sum(getattr(s, key) for s in runs) for key in ("speed_steps", "plain_steps", "fallbacks", "probes",
                                                                  "cost_samples")},
            "depth_steps": dict(sorted(depth_steps.items(), reverse=True)), "depth": last.depth,
            "step_cost": last.step_cost, "step_cost_source": last.step_cost_source, "bound": last.bound,
            "host_costs": last.host_costs}
