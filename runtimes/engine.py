"""Engine: the embeddable entry point.

    engine = Engine.load("out/small")                       # ONNX Runtime, CPU
    result = engine.generate("ROMEO:", max_new_tokens=64)   # -> .text, .ids, .stats
    stream = engine.stream("ROMEO:", max_new_tokens=64)     # confirmed text only, never speculation
    for piece in stream:
        print(piece, end="")
    stream.stats                                            # DecodeStats, once the stream is done

An engine is safe to share between threads: it owns one cache, so calls run one at a time (a call
waits for the one before it to finish; a stream holds the engine from its first piece to its last).
Every call runs on the continuous-batching scheduler (runtimes/batch.py): generate and stream as a
batch of one on the engine's own backend, generate_batch and batch_scheduler on pools of their own
over the same session (the engine graph is opened once: one copy of the weights per process). With the ONNX Runtime backend this imports numpy,
onnxruntime and tokenizers only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from speedc.format.artifact import TOKENIZER, Manifest, read_manifest
from speedc.errors import ArtifactError, BatchError, GenerationError, SpeedcError
from speedc.models.sampling import SamplingParams, require
from speedc.runtimes.speculation import DEFAULT_ROW_BUDGET, MODES
from speedc.runtimes.decode import DecodeStats, Decoding, Request, run_to_end
from speedc.runtimes.detokenize import DecodeRule, IncrementalText, cut_at_stop, decode_rule
from speedc.runtimes.exit_rule import SETTINGS as DEPTH_SETTINGS, DepthRules, depth_settings
from speedc.runtimes.requests import RequestChecks, sampling_params



@dataclass
class GenerationResult:
    ids: list[int]
    text: str | None
    stats: DecodeStats
    logprobs: list | None = None  # TokenLogprob per id, when asked (the final head's, before any penalty)
    prompt_logprobs: list | None = None  # TokenLogprob of prompt[1:], when asked

    def to_json(self) -> dict:
        return {"ids": self.ids, "text": self.text, "stats": self.stats.to_json()}


def _onnx(directory: Path, manifest: Manifest, max_batch: int, capacity: int, device: str, threads: int | None,
          kv_cache: str | None = None):
    from speedc.runtimes.backends.onnx import make_batch_backend

    return make_batch_backend(directory, manifest, max_batch, capacity, device=device, threads=threads,  # fused when built
                              kv_cache=kv_cache)


def _onnx_numpy(directory: Path, manifest: Manifest, max_batch: int, capacity: int, device: str, threads: int | None,
                kv_cache: str | None = None):
    from speedc.runtimes.backends.onnx import make_batch_backend

    return make_batch_backend(directory, manifest, max_batch, capacity, device=device, threads=threads, fused=False,
                              kv_cache=kv_cache)


def _torch(directory: Path, manifest: Manifest, max_batch: int, capacity: int, device: str, threads: int | None,
           kv_cache: str | None = None, compile_step: bool = False):
    if kv_cache not in (None, "float32"):
        raise GenerationError(f"{kv_cache} KV values need speedc's attention (--backend onnx); the PyTorch backend "
                              "keeps a float32 cache")
    try:
        from speedc.runtimes.backends.torch_backend import TorchBackend
    except ImportError as missing:
        if (missing.name or "").startswith("speedc"):  # our own import broke: not a missing extra
            raise
        raise SpeedcError(f"the PyTorch backend needs the compiler extra: pip install 'speedc[compiler]' "
                          f"({missing.name} is missing)") from None
    return TorchBackend(directory, manifest, max_batch=max_batch, capacity=capacity, device=device, threads=threads,
                        compile_step=compile_step)


@dataclass(frozen=True)
class BackendEntry:
    make: Callable  # (directory, manifest, max_batch, capacity, device, threads, kv_cache) -> a batch backend
    help: str


# --backend NAME -> how to make its batch backend (runtimes/backends/protocol.py); the CLI's choices and help come from here.
BACKENDS: dict[str, BackendEntry] = {
    "onnx": BackendEntry(_onnx, "ONNX Runtime on the CPU, IO binding, fused attention writing the cache in place"),
    "onnx-numpy": BackendEntry(_onnx_numpy, "ONNX Runtime on the CPU fed numpy views (standard graphs; the simplest path)"),
    "torch": BackendEntry(_torch, "PyTorch, CPU or CUDA (needs the compiler extra)"),
}
DEFAULT_BACKEND = "onnx"


def make_backend(directory: Path, manifest: Manifest, backend: str, device: str, threads: int | None, *,
                 max_batch: int = 1, capacity: int | None = None, compile_step: bool = False, kv_cache: str | None = None):
    """The batch backend BACKEND names, of MAX_BATCH pool rows of CAPACITY positions (None: the context).
    COMPILE_STEP: its step through torch.compile (the PyTorch backend's). KV_CACHE: the pool's values
    (kv_cache_choice; None: the default)."""
    entry = BACKENDS.get(backend)
    if entry is None:
        raise SpeedcError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    capacity = manifest.dims.max_context if capacity is None else capacity
    if compile_step:
        check_compile(backend)
        return entry.make(directory, manifest, max_batch, capacity, device, threads, kv_cache, compile_step=True)
    return entry.make(directory, manifest, max_batch, capacity, device, threads, kv_cache)


def check_compile(backend: str) -> None:
    """--compile (a step through torch.compile) is the PyTorch backend's alone."""
    if backend != "torch":
        raise SpeedcError(f"--compile compiles the PyTorch backend's step (torch.compile): use it with --backend torch, "
                          f"not {backend}")


def scheduled(scheduler, sequence) -> Decoding:
    """SEQUENCE's confirmed tokens as SCHEDULER (which runs it alone) confirms them; returns (ids, stats).
    Steps run only while the consumer asks for the next token, so a stream left early stops stepping."""
    from speedc.runtimes.sequence import DONE

    start = time.perf_counter()
    while sequence.state != DONE:
        for _, token in scheduler.step():  # one sequence: every event is its own
            if token is not None:
                yield token
    if sequence.error is not None:  # refused at admission (its cache could not be allocated)
        raise sequence.error
    stats = sequence.stats
    stats.decode_seconds = max(time.perf_counter() - start - stats.prefill_seconds, 0.0)  # as plain decoding counted it
    return sequence.out, stats


def pool_backend(engine: "Engine", max_batch: int, capacity: int, fused: bool | None, threads: int | None):
    """A batch backend with a pool of its own on ENGINE's session (its graph opened once per process); a new
    session only where FUSED or THREADS differ from the engine's."""
    from speedc.runtimes.backends.onnx import make_batch_backend

    own = engine.backend
    if fused in (None, own.fused) and threads in (None, engine.threads):
        return make_batch_backend(engine.directory, engine.manifest, max_batch, capacity, device=engine.device,
                                  fused=own.fused, session=own.session, kv_cache=own.kv_cache)
    return make_batch_backend(engine.directory, engine.manifest, max_batch, capacity, device=engine.device,
                              threads=threads, fused=fused, kv_cache=engine.kv_cache)


def check_batching(backend_name: str) -> None:
    from speedc.runtimes.backends.onnx import BATCHING_BACKENDS

    if backend_name not in BATCHING_BACKENDS:
        raise GenerationError(f"continuous batching runs on ONNX Runtime on the CPU, not --backend {backend_name}")


def load_tokenizer(path: Path):
    """The artifact's tokenizer (tokenizers.Tokenizer), or None where it has no tokenizer.json."""
    if not path.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SpeedcError("text prompts need the tokenizers package: pip install tokenizers") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as bad:  # the tokenizers package raises its own Exception type
        raise ArtifactError(f"{path}: cannot be loaded ({str(bad).splitlines()[0]}); rebuild the artifact") from None


class EngineLock:
    """The engine's one cache serves one call at a time; a call waits for the one before it. A thread
    asking while it holds it (a call made inside its own open stream) would wait for ever: that is a
    GenerationError instead. Released by whichever thread ends the call (a stream may be handed on)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None  # thread id that took it; only that thread compares equal

    def __enter__(self) -> "EngineLock":
        if self._holder == threading.get_ident():
            raise GenerationError("this thread holds the engine in an open stream: exhaust or close it "
                                  "(stream.close(), or `with engine.stream(...) as stream:`) before the next call")
        self._lock.acquire()
        self._holder = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        self._holder = None
        self._lock.release()


class _StreamOutcome:
    """What a stream's generator records (ids so far, stats at the end): shared with the TextStream
    without a reference back to it, so a stream dropped mid-way is freed, and its generator closed
    (releasing the engine), as soon as nothing refers to it (`for piece in engine.stream(...): break`)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.stats: DecodeStats | None = None
        self.cancelled = False  # set by close() from another thread: the stream ends at its next token


def _stream_pieces(decoding: Decoding, lock: EngineLock, text: IncrementalText, final: Callable[[list[int]], str],
                   outcome: _StreamOutcome) -> Iterator[str]:
    with lock:
        try:
            while not outcome.cancelled:
                try:
                    token = next(decoding)
                except StopIteration as done:
                    outcome.stats = done.value[1]
                    break
                outcome.ids.append(token)
                text.push(token)
                piece = text.take_settled()
                if piece:
                    yield piece
        finally:
            decoding.close()  # a stream left early ends its decoding while it still holds the engine
    if outcome.cancelled:
        return  # closed from another thread: no more text
    rest = text.take_rest(final(outcome.ids))
    if rest:
        yield rest


class TextStream:
    """Iterator of confirmed text pieces; `ids` and `stats` are complete once it is exhausted.

    It runs DECODING holding LOCK from its first piece until it ends, is closed, or is dropped (the
    engine's cache serves one call at a time); TEXT renders the confirmed ids a few at a time, FINAL
    renders them all once at the end (generate()'s text). Text that may be the start of a stop string
    is held back until it is known not to be one, so the pieces join to what generate() returns.
    Also a context manager (closed on exit)."""

    def __init__(self, decoding: Decoding, lock: EngineLock, text: IncrementalText,
                 final: Callable[[list[int]], str]) -> None:
        self._outcome = _StreamOutcome()
        self._pieces = _stream_pieces(decoding, lock, text, final, self._outcome)

    @property
    def ids(self) -> list[int]:
        return self._outcome.ids

    @property
    def stats(self) -> DecodeStats | None:
        return self._outcome.stats

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop early: the engine is free for the next call at once. From another thread than the one
        iterating (a client went away, say), the stream ends at its next token, and the engine then."""
        self._outcome.cancelled = True
        try:
            self._pieces.close()
        except ValueError:  # "generator already executing": another thread is inside next(); it sees the flag
            pass

    def __enter__(self) -> "TextStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Engine:
    def __init__(self, directory: Path, manifest: Manifest, backend, tokenizer, *, device: str = "cpu",
                 make_backend: Callable[[], object] | None = None, backend_name: str = DEFAULT_BACKEND,
                 threads: int | None = None, kv_cache: str | None = None) -> None:
        """BACKEND: the engine's batch backend (one pool row; its session serves every call, batched
        ones too), or None to have MAKE_BACKEND make it on first use. BACKEND_NAME: its name in BACKENDS
        (continuous batching runs on some only); THREADS: the intra-op threads its session was opened with;
        KV_CACHE: the KV cache's values asked for (None: the default; a backend resolves it: kv_cache_choice)."""
        self.directory, self.manifest, self.tokenizer, self.device = directory, manifest, tokenizer, device
        self.backend_name, self.threads, self.kv_cache = backend_name, threads, kv_cache
        self._backend, self._make_backend = backend, make_backend
        self._backend_lock = threading.Lock()
        self.eos_token_id, self.eos_token_ids = manifest.dims.eos_token_id, manifest.dims.eos_token_ids
        # Early flush is on by default: `speedc bench --early-flush/--no-early-flush` measures both.
        self.early_flush_default = True
        self._lock = EngineLock()  # one cache: one call at a time
        self._policy = None  # the speculation policy every call shares (what it learned outlives a call)
        self._costs: dict[int, object] = {}  # id of a session -> its StepCosts (step times measured on this host)
        self.prefix_cache = None  # single-sequence calls' prefix cache (set_prefix_cache)
        self.decode_rule = decode_rule(tokenizer) if tokenizer is not None else DecodeRule()
        self.requests = RequestChecks(manifest.dims, tokenizer, directory / TOKENIZER, self.decode_rule,
                                      DepthRules.of(manifest))

    def set_prefix_cache(self, megabytes: float | None) -> None:
        """Keep up to MEGABYTES MiB of K/V rows of the prompts and outputs of generate / stream, so a call
        whose prompt begins with an earlier call's tokens (a conversation's next turn) prefills only the
        rest (runtimes/prefix_cache.py); the output is the same. None or 0: off."""
        from speedc.runtimes.prefix_cache import PrefixCache

        require(megabytes, "prefix cache megabytes", "a number", optional=True)
        if megabytes is not None and not 0 <= megabytes < float("inf"):
            raise GenerationError("the prefix cache size must be a finite number >= 0")
        self.prefix_cache = PrefixCache(int(megabytes * (1 << 20))) if megabytes else None

    @property
    def backend(self):
        """The engine's batch backend (its session, and the pool single-sequence calls run in); a lazy
        engine opens it here, once."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
        return self._backend

    @backend.setter
    def backend(self, backend) -> None:
        self._backend = backend

    @property
    def backend_loaded(self) -> bool:
        return self._backend is not None

    @classmethod
    def load(cls, path: str | Path, *, backend: str = "onnx", device: str = "cpu", threads: int | None = None,
             verify: bool = False, lazy: bool = False, prefix_cache_mb: float | None = None,
             compile_step: bool = False, kv_cache: str | None = None) -> "Engine":
        """LAZY: open the backend (its session) only when a call first needs it. PREFIX_CACHE_MB:
        set_prefix_cache's. COMPILE_STEP (backend torch): the step through torch.compile, one compile per
        step shape on first use (seconds to minutes), then no Python between its operations. KV_CACHE:
        the KV cache's values where speedc's kernel attends ("float16", its default; "int8"; "float32")."""
        directory = Path(path)
        manifest = read_manifest(directory, verify_hashes=verify)
        tokenizer = load_tokenizer(directory / TOKENIZER)

        def make() -> object:
            return make_backend(directory, manifest, backend, device, threads, compile_step=compile_step, kv_cache=kv_cache)

        engine = cls(directory, manifest, None if lazy else make(), tokenizer, device=device, make_backend=make,
                     backend_name=backend, threads=threads, kv_cache=kv_cache)
        engine.set_prefix_cache(prefix_cache_mb)
        return engine

    # ---- helpers ---------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.requests.encode(prompt)

    def decode_text(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else None

    def incremental_text(self, stop: list[str] | None) -> IncrementalText:
        """The text of ids fed one at a time, for streams (a few ids decoded a token: detokenize.py)."""
        return IncrementalText(self.tokenizer.decode, stop, self.decode_rule)

    def _decoding(self, prompt, max_new_tokens: int, mode: str, sampling: SamplingParams, stop: list[str] | None,
                  stop_at_eos: bool, early_flush: bool | None, stop_token_ids=None) -> Decoding:
        request = self.make_request(prompt, max_new_tokens, sampling, stop, stop_at_eos, stop_token_ids)
        return self._schedule(request, mode, early_flush)

    def _schedule(self, request: Request, mode: str, early_flush: bool | None) -> Decoding:
        if mode not in MODES:
            raise GenerationError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        early_flush = self.flush_setting(early_flush)
        scheduler = self._single_scheduler(mode)
        sequence = scheduler.submit(request, early_flush=early_flush)
        sequence.stats.mode = self._mode_label(mode, sequence.early_flush)
        return scheduled(scheduler, sequence)

    @property
    def speculation_policy(self):
        """The acceptance policy of every adaptive call on this engine (runtimes/acceptance_policy.py): one
        object, so what it learned of this checkpoint's acceptance carries over from call to call."""
        if self._policy is None:
            from speedc.runtimes.acceptance_policy import AcceptancePolicy

            self._policy = AcceptancePolicy.for_manifest(self.manifest)
        return self._policy

    def step_costs(self, backend=None):
        """The step times measured on this host for BACKEND's session (None: the engine's backend), kept for
        the engine's life and shared by every scheduler on that session (runtimes/step_costs.py)."""
        from speedc.runtimes.step_costs import StepCosts

        backend = backend or self.backend
        runner = backend.runner
        costs = self._costs.get(id(runner))
        if costs is None:
            costs = self._costs[id(runner)] = StepCosts.for_manifest(self.manifest)
        return costs

    def _single_scheduler(self, mode: str):
        """A scheduler of one sequence on the engine's backend: speed speculates while the engine's policy
        says it pays (P > 1), speed-always at every step, autoregressive never. The whole prompt is one
        prefill chunk. Cheap: the backend keeps its pool and step bindings between calls, the engine its
        policy and step costs."""
        from speedc.runtimes.acceptance_policy import AlwaysSpeculate
        from speedc.runtimes.batch import BatchScheduler

        rules = MODES[mode]
        acceptance = self.speculation_policy if rules.per_sequence else AlwaysSpeculate()
        return BatchScheduler(self.backend, policy=rules.row_policy(batch=False), acceptance=acceptance, costs=self.step_costs(),
                              prefill_chunk=self.manifest.dims.max_context, first_token_alone=True,
                              prefix_cache=self.prefix_cache)

    def _mode_label(self, mode: str, early_flush: bool) -> str:
        """DecodeStats.mode of a single-sequence call."""
        if mode == "autoregressive":
            return mode
        if self.manifest.slots == 1:
            return "speed (plain engine: P=1)"
        return mode + (" +early-flush" if early_flush else "")

    def make_request(self, prompt, max_new_tokens: int, sampling: SamplingParams, stop: list[str] | None,
                     stop_at_eos: bool, stop_token_ids=None, prompt_logprobs: int | None = None,
                     grammar=None, depth: dict | None = None) -> Request:
        """A checked request (GenerationError on bad input): RequestChecks.make (runtimes/requests.py)."""
        return self.requests.make(prompt, max_new_tokens, sampling, stop, stop_at_eos, stop_token_ids, prompt_logprobs,
                                  grammar, depth)

    def grammar_constraint(self, grammar, ends):
        return self.requests.grammar_constraint(grammar, ends)

    def end_ids(self, stop_at_eos: bool, stop_token_ids=None) -> frozenset[int]:
        return self.requests.end_ids(stop_at_eos, stop_token_ids)

    def trim(self, text: str | None, stop: list[str] | None) -> str | None:
        """TEXT cut before the first stop string in it."""
        return None if text is None else cut_at_stop(text, stop)

    # ---- continuous batching (runtimes/batch.py) -------------------------------------------------
    def batch_scheduler(self, *, max_batch: int = 8, kv_cache_mb: float | None = None,
                        row_budget: int | None = DEFAULT_ROW_BUDGET, per_sequence: bool = True, prefill_chunk: int = 128,
                        fused: bool | None = None, threads: int | None = None, backend=None,
                        prefix_cache_mb: float | None = None):
        """A scheduler over a new KV-cache pool of MAX_BATCH rows (each of kv_cache_mb / max_batch,
        at most the model's context; None: the full context). ROW_BUDGET: the most rows a speculating step may
        run (RowPolicy; None: no limit, 0: never speculate). PER_SEQUENCE: a sequence whose own
        acceptance makes speculation a loss decodes plainly (runtimes/acceptance_policy.py). The pool is
        its own: single-sequence calls on this engine are unaffected; its session is the engine's (unless
        FUSED or THREADS ask for others). BACKEND: run on this BatchBackend (its session and pool;
        max_batch, kv_cache_mb, fused and threads then come from it) instead of making one, for schedulers
        that take turns on one pool, never at once (the concurrency bench's policies). PREFIX_CACHE_MB:
        a prefix cache of its own of that many MiB (runtimes/prefix_cache.py; None or 0: none)."""
        from speedc.runtimes.acceptance_policy import AlwaysSpeculate
        from speedc.runtimes.batch import BatchScheduler
        from speedc.runtimes.speculation import RowPolicy
        from speedc.runtimes.backends.onnx import row_capacity
        from speedc.runtimes.prefix_cache import PrefixCache

        check_batching(self.backend_name)
        require(max_batch, "max_batch", "an integer")  # 2.0 pool rows or a float chunk would fail deep inside a step
        require(prefill_chunk, "prefill_chunk", "an integer")
        require(row_budget, "row_budget", "an integer", optional=True)
        if row_budget is not None and row_budget < 0:
            raise GenerationError(f"row_budget must be >= 0 (None: no limit), not {row_budget}")
        require(kv_cache_mb, "kv_cache_mb", "a number", optional=True)
        if prefill_chunk < 1:
            raise GenerationError("prefill_chunk must be at least 1")
        if backend is None:  # a pool on the engine's session keeps its dtype (float16 where the kernel attends)
            same = fused in (None, getattr(self.backend, "fused", None)) and threads in (None, self.threads)
            value_bytes = getattr(self.backend, "cache_value_bytes", 4) if same else 4
            capacity = row_capacity(self.manifest, max_batch, kv_cache_mb, value_bytes)
            backend = pool_backend(self, max_batch, capacity, fused, threads)
        policy = RowPolicy(row_budget=row_budget)
        acceptance = self.speculation_policy if per_sequence else AlwaysSpeculate()
        require(prefix_cache_mb, "prefix_cache_mb", "a number", optional=True)
        if prefix_cache_mb is not None and not 0 <= prefix_cache_mb < float("inf"):
            raise GenerationError("prefix_cache_mb must be a finite number >= 0")
        cache = PrefixCache(int(prefix_cache_mb * (1 << 20))) if prefix_cache_mb else None
        return BatchScheduler(backend, policy=policy, acceptance=acceptance, prefill_chunk=prefill_chunk,
                              costs=self.step_costs(backend), prefix_cache=cache)

    def generate_batch(self, prompts: list[str | list[int]], *, max_new_tokens: int = 64, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, seed: int | None = None, repetition_penalty: float = 1.0,
                       stop: list[str] | None = None, stop_at_eos: bool = True, early_flush: bool | None = None,
                       settings: list[dict] | None = None, scheduler=None, **batch_options) -> list[GenerationResult]:
        """One result per prompt, in order, all decoded together (continuous batching). SETTINGS: per-prompt
        overrides of the keyword arguments (e.g. each its own seed; generate's depth rules too). Each result
        equals what its prompt produces alone with plain decoding. A prompt whose KV cache cannot be allocated even alone
        (out of memory) fails alone: BatchError, whose results hold the others'. BATCH_OPTIONS go to
        batch_scheduler (max_batch, kv_cache_mb, ...)."""
        common = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                      repetition_penalty=repetition_penalty, stop=stop, stop_at_eos=stop_at_eos, early_flush=early_flush,
                      **{name: batch_options.pop(name) for name in DEPTH_SETTINGS if name in batch_options})
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):  # a str: one prompt a character
            raise GenerationError(f"prompts must be a list (of texts or id lists), not {type(prompts).__name__}")
        if settings is not None and len(settings) != len(prompts):
            raise GenerationError(f"{len(settings)} settings for {len(prompts)} prompts")
        if settings is not None and not all(isinstance(one, dict) for one in settings):
            raise GenerationError("settings must be a list of dicts of generate()'s keyword arguments, one a prompt")
        check_batching(self.backend_name)
        requests = []  # every prompt checked before any is queued: a bad one leaves nothing behind
        for number, prompt in enumerate(prompts, 1):
            params = {**common, **(settings[number - 1] if settings else {})}
            try:
                requests.append((self.request_from(prompt, params), params))
            except GenerationError as bad:
                raise GenerationError(f"prompt {number}: {bad}") from None
        scheduler = scheduler or self.batch_scheduler(**batch_options)
        sequences = []
        for number, (request, params) in enumerate(requests, 1):
            try:
                sequences.append((scheduler.submit(request, early_flush=self.flush_setting(params["early_flush"])),
                                  params["stop"]))
            except GenerationError as bad:  # e.g. longer than a pool row: the ones queued leave with it
                for sequence, _ in sequences:
                    scheduler.cancel(sequence)
                raise GenerationError(f"prompt {number}: {bad}") from None
        scheduler.run()
        results = [None if seq.error else GenerationResult(seq.out, self.trim(self.decode_text(seq.out), stop), seq.stats)
                   for seq, stop in sequences]
        failed = [(number, seq.error) for number, (seq, _) in enumerate(sequences, 1) if seq.error]
        if failed:
            numbers = ", ".join(str(number) for number, _ in failed)
            raise BatchError(f"prompt {numbers}: {failed[0][1]}" if len(failed) == 1 else
                             f"prompts {numbers}: {failed[0][1]}", results)
        return results

    def request_from(self, prompt, params: dict) -> Request:
        """make_request from generate()'s keyword arguments."""
        self.flush_setting(params.get("early_flush"))  # checked with the rest, before anything is queued
        return self.requests.from_settings(prompt, params)

    def flush_setting(self, early_flush: bool | None) -> bool:
        """Early flush as asked, else the engine's default."""
        if early_flush is not None and not isinstance(early_flush, bool):
            raise GenerationError(f"early_flush must be True, False or None, not {type(early_flush).__name__}")
        return self.early_flush_default if early_flush is None else early_flush

    # ---- public API ------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], *, max_new_tokens: int = 64, mode: str = "speed",
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 repetition_penalty: float = 1.0, stop: list[str] | None = None, stop_at_eos: bool = True,
                 early_flush: bool | None = None, stop_token_ids: list[int] | None = None,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 grammar: str | None = None, loops: int | None = None, exit_at_step: int | None = None,
                 exit_threshold: float | None = None, weighted_exit: bool = False) -> GenerationResult:
        """LOGPROBS / PROMPT_LOGPROBS: record each new / prompt token's log-probability (the final head's,
        before bias and penalties) with this many top alternatives (result.logprobs, .prompt_logprobs).
        GRAMMAR: an llguidance grammar string the output follows (make_request). LOOPS, EXIT_AT_STEP,
        EXIT_THRESHOLD, WEIGHTED_EXIT: a looped model's own depth rules (Ouro's; a recurrent core's LOOPS: Huginn's
        num_steps; runtimes/exit_rule.py), stats.exit_loops the loops tokens exited at."""
        sampling = sampling_params(temperature, top_k, top_p, repetition_penalty, seed, presence_penalty,
                                   frequency_penalty, logit_bias, logprobs)
        request = self.make_request(prompt, max_new_tokens, sampling, stop, stop_at_eos, stop_token_ids, prompt_logprobs,
                                    grammar, depth_settings(loops, exit_at_step, exit_threshold, weighted_exit))
        decoding = self._schedule(request, mode, early_flush)
        with self._lock:  # a decoding touches the backend (the one cache) only while it runs
            ids, stats = run_to_end(decoding)
        return GenerationResult(ids, self.trim(self.decode_text(ids), stop), stats,
                                list(request.picker.logprobs) if logprobs is not None else None,
                                list(request.prompt_logprob_values) if prompt_logprobs is not None else None)

    def stream(self, prompt: str | list[int], *, max_new_tokens: int = 64, mode: str = "speed",
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               repetition_penalty: float = 1.0, stop: list[str] | None = None, stop_at_eos: bool = True,
               early_flush: bool | None = None, stop_token_ids: list[int] | None = None,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
               logprobs: int | None = None, prompt_logprobs: int | None = None,
               grammar: str | None = None, loops: int | None = None, exit_at_step: int | None = None,
               exit_threshold: float | None = None, weighted_exit: bool = False) -> TextStream:
        """Text pieces as tokens are confirmed by the full model (never a speculated token). Bad
        requests fail here, before anything is yielded; the returned stream carries ids and stats."""
        if self.tokenizer is None:
            raise GenerationError("streaming text needs a tokenizer; this artifact has none")
        sampling = sampling_params(temperature, top_k, top_p, repetition_penalty, seed, presence_penalty,
                                   frequency_penalty, logit_bias, logprobs)
        # Checks run now; the decoding itself starts (and takes the lock) at the stream's first piece.
        request = self.make_request(prompt, max_new_tokens, sampling, stop, stop_at_eos, stop_token_ids, prompt_logprobs,
                                    grammar, depth_settings(loops, exit_at_step, exit_threshold, weighted_exit))
        decoding = self._schedule(request, mode, early_flush)
        stream = TextStream(decoding, self._lock, self.incremental_text(stop),
                            lambda ids: self.trim(self.decode_text(ids), stop))
        stream.request = request  # its picker's log-probabilities, the prompt's (the server's single-sequence path)
        return stream
