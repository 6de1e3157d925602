"""What a decode step costs on the host the runtime runs on, measured as it runs (runtimes/batch.py times
every decode step it takes and records it here; the acceptance policy decides with it).

Whether SPEED pays is a fact about the machine and the moment: its compute per byte of memory, the pool
length (attention runs over the whole bound cache, so a step's cost follows the pool's length T, not the
positions in use), the batch size, the load of other processes. So the costs are kept per

    (kind, sequences decoded together n, context band = the smallest power of two >= T, at least 64)

kind "plain": a plain step of n tokens; "speed": a speed step of n pipelines, however full (refill steps
after a flush run fewer rows and cost less: the mean over the steps taken is what a token costs at
this acceptance, the analytic bound's 1 + (1 - alpha)(P - 1) steps a token times it); "full": a speed
step with every slot of every pipeline filled, the step `speedc inspect --measure` times (c(P) as
SPEED.md defines it). A pipeline run at a shallower depth d = P / g (decode.Pipeline.shift's spacing g:
at most d tokens in flight, d rows a step) keeps its speed steps as "speed@d" / "full@d"; its c(d) is
P x its step / a plain step (g steps of d rows a token, against a plain token's d slots of N / d layers).

Each is the unslowed mean (unslowed_mean) of WINDOW samples (PLAIN_WINDOW for plain steps): on a shared host
a step is only ever slowed, by other processes taking a core from a thread the step waits on (measured on
zoo:small at a load of 4 on 2 cores: plain tokens of 2.5 ms and of 10.6 ms, two of three slow), so steps
beyond 1.5x the lower quartile are not counted; a lower quartile itself sits below the mean by the step's own
jitter, larger for a speed step's, which made c low. A speed step's cost also follows the heads it runs (a
vocabulary readout per draft and per token leaving the last slot, a candidates' check per early-flush
check: measured at Ouro-1.4B's shapes, 4 layers, int4, 8.5 ms with none to 14.6 with four), and at a low
acceptance most steps run few: the lower quartile of that mixture was its cheap steps' (c(4) 1.46 where
speed-always's runs gave 1.8, and speculation at acceptance 0.3 went on for 200 steps). So samples are
grouped by their count of head rows: the estimate is the mix of the last window, each group at its own
level (_Samples.typical; c 1.71 against 1.73 from the runs).

The first WARMUP steps of each (kind, n) at each pool shape (length, width) are not samples (the first
runs of a shape bind buffers and warm ONNX Runtime's kernels: measured, the first plain
tokens over a new pool length of a 4-layer Ouro-1.4B-shaped int4 model took ~125 ms against 14), nor
is the first decode step after the pool was reallocated (the scheduler skips it: new bindings).

    c(n, band) = P * speed seconds / plain seconds        (the cost the policy's bound uses)

where the speed seconds' levels are of the speed steps taken nearest in time to the newest plain
samples (plain steps are timed in bursts, hundreds of speed steps apart: a ratio of two moments would follow
the host's load, not the step).

Before both kinds are measured in a band the nearest band (same n) where both are stands in, else the
seed: the build host's c(P) stored in the manifest, or the cost model's assumption.
Standard library only (the runtime path imports no torch).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

MIN_BAND = 64
SLOWED = 1.5
REUSE_STEPS = 32
DEPTH_REFRESH = 4


def seed_step_cost(manifest) -> tuple[float, str]:
    """(c(P), where it comes from) before anything is measured here: the manifest's build-time measurement when
    it was taken at this P and is plausible, else the cost model's assumption (the one the compiler chose P
    with). A c below 1 is no measurement (P rows never cost less than one row's pass: a build on a loaded
    host measured c(2) = 0.89)."""
    from speedc.cost_model import assumed_step_cost, describe_assumed_step_cost

    measured = (manifest.build or {}).get("step_cost_measured") or {}
    if measured.get("slots") == manifest.slots and (measured.get("step_cost") or 0) >= 1.0:
        return float(measured["step_cost"]), "measured at build"
    return assumed_step_cost(manifest.slots), f"{describe_assumed_step_cost()}, not measured"


def lower_quartile(values: list[float]) -> float:
    return sorted(values)[len(values) // 4]


def unslowed_mean(values: list[float]) -> float:
    """The mean of VALUES that were not slowed: those within SLOWED x their lower quartile (a step slowed by
    another process took 2-4x its time; the jitter of an unslowed one stays within 1.4x)."""
    floor = SLOWED * lower_quartile(values)
    kept = [value for value in values if value <= floor]
    return sum(kept) / len(kept)


def context_band(length: int) -> int:
    """The band of a pool of LENGTH positions: the smallest power of two >= it, at least MIN_BAND."""
    return max(MIN_BAND, 1 << max(int(length) - 1, 0).bit_length())


@dataclass
class _Samples:
    """One (kind, n, band)'s step times, kept per count of head rows (in clock order, with the StepCosts.clock
    of each), and the head rows of each step in the order taken (the mix)."""
    history: int  # samples kept: of the mix, and of each head-row count
    heads: deque = field(init=False)
    groups: dict = field(default_factory=dict)  # head rows -> (seconds, clocks): deques of at most `history`
    newest: int = 0  # clock of the newest sample

    def __post_init__(self):
        self.heads = deque(maxlen=self.history)

    def __len__(self) -> int:
        return len(self.heads)

    def add(self, seconds: float, clock: int, heads: int) -> None:
        if heads not in self.groups:
            self.groups[heads] = (deque(maxlen=self.history), deque(maxlen=self.history))
        group_seconds, group_clocks = self.groups[heads]
        group_seconds.append(seconds)
        group_clocks.append(clock)
        self.heads.append(heads)
        self.newest = clock

    def typical(self, count: int, nearest_to: int | None = None) -> float:
        """A step at the mix of head rows of the last COUNT steps: per head-row count, the unslowed mean of
        its COUNT samples taken nearest to clock NEAREST_TO (None: its newest), weighted by its share of the mix.
        The mix is now's (what the batch's acceptance makes its steps run); the levels are of the moment asked
        (a plain burst's, to pair with it)."""
        mix = Counter(itertools.islice(self.heads, max(0, len(self.heads) - count), None))
        clock = self.newest if nearest_to is None else nearest_to
        total = 0.0
        for group, share in mix.items():
            seconds, clocks = self.groups[group]
            middle = bisect.bisect_left(clocks, clock)
            start = max(0, min(middle - count // 2, len(clocks) - count))
            total += share * unslowed_mean(list(itertools.islice(seconds, start, start + count)))
        return total / sum(mix.values())


@dataclass
class StepCosts:
    """Step times of one engine's session on this host (shared by every scheduler of the engine)."""
    slots: int  # P
    seed: float  # c(P) before anything is measured here
    seed_source: str
    window: int = 16  # speed steps a quartile is taken over
    plain_window: int = 8  # plain steps a quartile is taken over: the last burst or two (plain steps are timed in bursts)
    warmup: int = 2
    min_samples: int = 3  # samples a (kind, n, band) needs before its median counts
    # Decode steps (any n, any band) after which a plain estimate is stale: a speculating scheduler then runs a
    # few plain steps to time it (BatchScheduler._plain_burst), when no pipeline holds work, or at twice this.
    refresh_steps: int = 512
    measuring: bool = True  # False: the seed stands for every step (a scripted cost, for tests of the rules)
    clock: int = 0  # decode steps recorded or skipped so far
    _samples: dict = field(default_factory=dict)  # (kind, n, band) -> _Samples
    _seen: Counter = field(default_factory=Counter)  # (kind, n, pool length, pool width) -> steps seen (warm-up)
    # (kind, n, band) -> _measured's answer: asked several times a step, it moves slowly (windows of 8-16 samples),
    # so it is recomputed at each of the first plain_window plain samples in a row (a burst's), when a kind
    # first has min_samples (c moves from the seed to this host's) and every REUSE_STEPS steps. One answer
    # takes ~21 us, four are asked a step at P = 4, and work between two session runs also slows the next
    # run (runtimes/speculation.py DECISION_REUSE).
    _answers: dict = field(default_factory=dict)
    _plain_run: int = 0  # plain samples recorded in a row

    @classmethod
    def for_manifest(cls, manifest, **knobs) -> "StepCosts":
        return cls(manifest.slots, *seed_step_cost(manifest), **knobs)

    def tick(self) -> None:
        """A decode step ran that is not a sample (right after the pool was reallocated)."""
        self.clock += 1

    def kind_at(self, kind: str, depth: int | None) -> str:
        """The key of a KIND ("speed", "full") step at pipeline DEPTH (None or P: the artifact's own)."""
        return kind if depth in (None, self.slots) else f"{kind}@{depth}"

    def record(self, kind: str, sequences: int, length: int, seconds: float, width: int = 1, heads: int = 0) -> None:
        """One KIND step of SEQUENCES sequences over a pool of LENGTH positions (WIDTH rows) that ran HEADS
        head rows (a speed step's readouts and checks; 0 where every step of the kind runs the same) took
        SECONDS."""
        if not kind.startswith("full"):  # a full step is also a speed step: counted once
            self.clock += 1
        if not self.measuring:
            return
        self._seen[kind, sequences, length, width] += 1
        if self._seen[kind, sequences, length, width] <= self.warmup:
            return
        key = (kind, sequences, context_band(length))
        samples = self._samples.get(key)
        if samples is None:
            history = self.plain_window if kind == "plain" else self.refresh_steps  # speed steps near each burst
            samples = self._samples[key] = _Samples(history)
        samples.add(seconds, self.clock, heads)
        self._plain_run = self._plain_run + 1 if kind == "plain" else 0
        if (0 < self._plain_run <= self.plain_window or len(samples) == self.min_samples
                or self.clock % REUSE_STEPS == 0):
            self._answers.clear()

    def seconds(self, kind: str, sequences: int, band: int, nearest_to: int | None = None) -> float | None:
        """Seconds of a KIND step of SEQUENCES sequences in BAND (_Samples.typical over the window, plain_window
        for plain steps; levels of the moment NEAREST_TO, None: now); None before min_samples."""
        samples = self._samples.get((kind, sequences, band))
        if samples is None or len(samples) < self.min_samples:
            return None
        return samples.typical(self.plain_window if kind == "plain" else self.window, nearest_to)

    def needs_plain_sample(self, sequences: int, length: int) -> bool:
        """Whether the plain cost of SEQUENCES sequences at a pool of LENGTH positions is unknown or stale."""
        if not self.measuring:
            return False
        samples = self._samples.get(("plain", sequences, context_band(length)))
        return (samples is None or len(samples) < self.min_samples
                or self.clock - samples.newest > self.refresh_steps)

    def needs_depth_sample(self, sequences: int, length: int, depth: int) -> bool:
        """Whether speed steps at DEPTH of SEQUENCES sequences at a pool of LENGTH positions are unknown or stale
        (after DEPTH_REFRESH x refresh_steps: a depth not chosen is timed by running it a few steps, which costs
        a change of spacing each way, ~4% of 128 tokens at Ouro-1.4B's shapes, and depths' costs keep their
        ratio better than the host keeps its load)."""
        if not self.measuring:
            return False
        samples = self._samples.get((self.kind_at("speed", depth), sequences, context_band(length)))
        return (samples is None or len(samples) < self.min_samples
                or self.clock - samples.newest > DEPTH_REFRESH * self.refresh_steps)

    def _measured(self, kind: str, sequences: int, band: int) -> tuple[float, str] | None:
        key = (kind, sequences, band)
        if key not in self._answers:
            self._answers[key] = self._measure(kind, sequences, band)
        return self._answers[key]

    def _measure(self, kind: str, sequences: int, band: int) -> tuple[float, str] | None:
        """P x KIND step / plain step in BAND, else in the nearest band where both were measured. A c below 1
        is no measurement: P rows never cost less than one row's pass (a step of P rows against P passes of
        one), so it says the plain steps were slowed by something else (seen on a host at load 6: plain steps
        of 240 ms beside speed steps of 30), and the seed decides instead."""
        near_first = sorted((abs(b.bit_length() - band.bit_length()), b) for k, n, b in self._samples
                            if k == kind and n == sequences)
        for _, near in near_first:
            plain = self.seconds("plain", sequences, near)
            # Paired in time: the speed steps taken nearest to the plain ones (a burst's neighbours), since load
            # that comes and goes on a shared host moves both kinds alike but not a ratio of different moments
            # (measured on zoo:small: a plain burst in a quiet second against later, slowed speed steps put c(4)
            # at 3.2 where paired samples gave 1.9-2.1, and speculation at acceptance 0.8 fell back).
            plain_clock = self._samples["plain", sequences, near].newest if plain is not None else 0
            step = self.seconds(kind, sequences, near, nearest_to=plain_clock) if plain is not None else None
            if step is not None and plain is not None and self.slots * step >= plain:
                where = "here" if near == band else f"at context band {near} (none yet at {band})"
                return self.slots * step / plain, f"measured {where}"
        return None

    def measured_here(self, sequences: int, depth: int | None = None) -> bool:
        """Whether c at pipeline DEPTH (None: P) for SEQUENCES sequences rests on this host's steps (in some
        context band) rather than the seed. Always True when not measuring (the seed is the scripted cost)."""
        if not self.measuring:
            return True
        return self._measured(self.kind_at("speed", depth), sequences, MIN_BAND) is not None  # any band will do

    def plain_age(self, sequences: int, length: int) -> int:
        """Decode steps since a plain step of SEQUENCES sequences at a pool of LENGTH positions was last timed
        (0 when not measuring: the seed never ages)."""
        if not self.measuring:
            return 0
        samples = self._samples.get(("plain", sequences, context_band(length)))
        return self.clock - samples.newest if samples is not None else self.clock

    def plain_overdue(self, sequences: int, length: int) -> bool:
        """Whether plain decoding's cost here was never measured or is twice as stale as refresh_steps."""
        if not self.measuring:
            return False
        samples = self._samples.get(("plain", sequences, context_band(length)))
        return samples is None or self.clock - samples.newest > 2 * self.refresh_steps

    def step_cost(self, sequences: int, length: int, kind: str = "speed", depth: int | None = None) -> tuple[float, str]:
        """(c, where it comes from) for SEQUENCES sequences at a pool of LENGTH positions and pipeline DEPTH (None:
        P): P x a KIND step's seconds / a plain step's, measured in this band, else the nearest band measured,
        else the seed (at a shallower depth scaled along the cost model's c(d) = 1 + 0.2 (d - 1)). Never
        another depth's measurement: a depth judged by another's would never run, so never be measured."""
        from speedc.cost_model import assumed_step_cost

        depth = self.slots if depth is None else depth
        found = self._measured(self.kind_at(kind, depth), sequences, context_band(length))
        if found is not None:
            return found
        if depth == self.slots:
            return self.seed, self.seed_source
        return self.seed * assumed_step_cost(depth) / assumed_step_cost(self.slots), f"{self.seed_source}, scaled to depth {depth}"

    def _depth_row(self, sequences: int, band: int, depth: int, plain: float | None) -> dict:
        """The mean speed and full step at DEPTH in ms, and the c each gives over PLAIN seconds."""
        row = {}
        plain_clock = self._samples["plain", sequences, band].newest if plain else None
        for kind, name in (("speed", "mean_step_cost"), ("full", "step_cost")):
            seconds = self.seconds(self.kind_at(kind, depth), sequences, band)
            if seconds is not None:
                row[f"{kind}_ms"] = round(1000 * seconds, 3)
                if plain:  # c as the policy takes it: paired with the plain steps in time
                    paired = self.seconds(self.kind_at(kind, depth), sequences, band, nearest_to=plain_clock)
                    row[name] = round(self.slots * paired / plain, 3)
        return row

    def depths_seen(self) -> set[int]:
        return {int(k.split("@")[1]) for k, _, _ in self._samples if "@" in k}

    def report(self) -> dict:
        """What was measured: per (n, band) the plain, mean speed and full step in ms, and c from each (the
        artifact's depth P at the top, shallower depths run at run time under "depths"); the seed beside them."""
        rows = []
        for n, band in sorted({(n, b) for _, n, b in self._samples}):
            plain = self.seconds("plain", n, band)
            row = {"sequences": n, "context_band": band, **self._depth_row(n, band, self.slots, plain)}
            if plain is not None:
                row["plain_ms"] = round(1000 * plain, 3)
            shallower = {d: self._depth_row(n, band, d, plain) for d in sorted(self.depths_seen(), reverse=True)}
            shallower = {d: values for d, values in shallower.items() if values}
            if shallower:
                row["depths"] = shallower
            rows.append(row)
        return {"slots": self.slots, "seed_step_cost": round(self.seed, 3), "seed_source": self.seed_source,
                "measured": rows}
