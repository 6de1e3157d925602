"""Training a shared-weight decoder with the early-exit loss.

    loss = CE(final head) + exit_weight * CE(exit head)

The exit head is the speculation source for SPEED, so its agreement with the final head (top-1 and
top-2) is reported on validation data: that is the acceptance rate the runtime will see.

Outputs in OUT (a loadable checkpoint at every save):
    config.json, model.safetensors, tokenizer.json   the checkpoint (fp32 while training)
    training.json                                    step, corpus hash, metrics history, wall time
    optimizer.state                                  AdamW moments (safetensors format) for --resume
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from speedc.errors import SpeedcError
from speedc.models.checkpoint.torch_io import load_checkpoint, model_from_state, write_atomic, write_checkpoint_files
from speedc.models.checkpoint.files import TOKENIZER_FILE, TRAINING_FILE
from speedc.models.config import ModelConfig
from speedc.models.families import read_config
from speedc.models.corpus import corpus_hash, load_documents
from speedc.models.llama import SharedLlama
from speedc.models.presets import PRESETS
from speedc.models.tokenizer import EOS_TOKEN, train_tokenizer

STATE_FILE = TRAINING_FILE
OPTIMIZER_FILE = "optimizer.state"


@dataclass
class TrainOptions:
    corpus: list[str] = field(default_factory=lambda: ["shakespeare"])
    preset: str = "tiny"
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.05
    exit_weight: float = 0.5
    eval_every: int = 200
    eval_batches: int = 8
    save_every: int = 200
    seed: int = 0
    threads: int = 0  # 0: torch default
    bf16: bool = True  # bf16 autocast for the training forward/backward (fp32 master weights, fp32 eval)


def _init_weights(model: SharedLlama, cfg: ModelConfig) -> None:
    gen = torch.Generator().manual_seed(1234)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            continue
        std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=gen) * std)


class TokenStream:
    """All documents tokenised into one id stream (EOS between works), split train / validation."""

    def __init__(self, docs: list[str], tokenizer: Tokenizer, val_fraction: float = 0.02) -> None:
        eos = tokenizer.token_to_id(EOS_TOKEN)
        ids: list[int] = []
        for enc in tokenizer.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eos)
        stream = torch.tensor(ids, dtype=torch.long)
        n_val = max(int(len(stream) * val_fraction), 1)
        self.train, self.val = stream[:-n_val], stream[-n_val:]

    def batch(self, split: str, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise SpeedcError(f"corpus too small: {len(data)} {split} tokens for sequence length {seq_len}")
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
        return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])  # [B, seq_len+1]


def exit_losses(model: SharedLlama, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """batch [B, L+1] -> (final CE, exit CE, final logits, exit logits)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model(inputs, with_exit=True)
    vocab = out.logits.shape[-1]
    final = F.cross_entropy(out.logits.reshape(-1, vocab).float(), targets.reshape(-1))
    early = F.cross_entropy(out.exit_logits.reshape(-1, vocab).float(), targets.reshape(-1))
    return final, early, out.logits, out.exit_logits


@torch.no_grad()
def evaluate(model: SharedLlama, stream: TokenStream, opts: TrainOptions) -> dict[str, float]:
    """Validation loss at the exit and at the end, and exit/final agreement (top-1, top-2)."""
    model.eval()
    gen = torch.Generator().manual_seed(999)  # the same validation windows every time
    totals = {"val_loss_final": 0.0, "val_loss_exit": 0.0, "agree_top1": 0.0, "agree_top2": 0.0}
    for _ in range(opts.eval_batches):
        final, early, logits, exit_logits = exit_losses(model, stream.batch("val", opts.batch_size, opts.seq_len, gen))
        target = logits.argmax(-1)  # what the full model emits (greedy)
        top2 = exit_logits.topk(2, dim=-1).indices
        totals["val_loss_final"] += final.item()
        totals["val_loss_exit"] += early.item()
        totals["agree_top1"] += (top2[..., 0] == target).float().mean().item()
        totals["agree_top2"] += (top2 == target[..., None]).any(-1).float().mean().item()
    model.train()
    return {k: round(v / opts.eval_batches, 4) for k, v in totals.items()}


def _lr_at(step: int, opts: TrainOptions) -> float:
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = min((step - opts.warmup) / max(opts.steps - opts.warmup, 1), 1.0)
    return opts.lr * (opts.min_lr_ratio + (1 - opts.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _save(out: Path, model: SharedLlama, optimizer: torch.optim.Optimizer, state: dict, tokenizer_json: str) -> None:
    params = dict(model.named_parameters())
    moments = {}
    for name, param in params.items():
        st = optimizer.state.get(param)
        if st:
            moments[f"{name}::exp_avg"] = st["exp_avg"].contiguous()
            moments[f"{name}::exp_avg_sq"] = st["exp_avg_sq"].contiguous()
            state["adam_step"] = float(st["step"])
    write_checkpoint_files(out, model, tokenizer_json=tokenizer_json)
    write_atomic(out / OPTIMIZER_FILE, lambda p: save_file(moments, str(p)))
    write_atomic(out / STATE_FILE, lambda p: p.write_text(json.dumps(state, indent=2) + "\n"))


RUN_SETTINGS = ("preset", "batch_size", "seq_len", "lr", "exit_weight", "seed", "bf16")  # fixed for a run's life
RESUMABLE_SETTINGS = ("steps", "eval_every", "save_every", "threads")  # a resumed run takes these anew


def _resumed_options(out: Path, saved: dict, opts: TrainOptions, given: frozenset[str]) -> TrainOptions:
    """The saved run's options, with the RESUMABLE_SETTINGS the caller GIVEN (steps always). A run setting
    given with another value than the run's is refused: it was silently ignored before."""
    for name in sorted(given & set(RUN_SETTINGS)):
        value, theirs = getattr(opts, name), saved.get(name, getattr(TrainOptions(), name))  # older runs: the default
        if value != theirs:
            flag = f"--{name.replace('_', '-')}"
            said, had = ((f"--{'' if value else 'no-'}{name}", f"--{'' if theirs else 'no-'}{name}") if isinstance(value, bool)
                         else (f"{flag} {value}", str(theirs)))
            raise SpeedcError(f"{out}: {said} differs from the run's {had}; a resumed run keeps its settings (it may "
                              f"change {', '.join('--' + n.replace('_', '-') for n in RESUMABLE_SETTINGS)})")
    changed = {name: getattr(opts, name) for name in RESUMABLE_SETTINGS if name == "steps" or name in given}
    try:
        return TrainOptions(**{**saved, **changed})
    except TypeError as bad:
        raise SpeedcError(f"{out / STATE_FILE}: unreadable training state ({bad})") from None


def _saved_state(out: Path) -> dict:
    try:
        state = json.loads((out / STATE_FILE).read_text())
        if not (isinstance(state, dict) and isinstance(state["options"], dict) and isinstance(state["step"], int)
                and isinstance(state["corpus_sha256"], str) and isinstance(state.get("history", []), list)
                and isinstance(state.get("wall_seconds", 0.0), (int, float))):
            raise TypeError("not a training state")
        for key, empty in (("history", []), ("wall_seconds", 0.0), ("tokens_seen", 0)):
            state.setdefault(key, empty)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as bad:
        raise SpeedcError(f"{out / STATE_FILE}: unreadable training state ({type(bad).__name__}: {bad}); cannot "
                          "resume this run") from None
    return state


def _saved_moments(out: Path, model: torch.nn.Module) -> dict:
    """The optimizer's moments saved with the run, each of its parameter's shape (SpeedcError if not)."""
    try:
        moments = load_file(str(out / OPTIMIZER_FILE))
    except Exception as bad:  # safetensors raises its own error types for a damaged file
        raise SpeedcError(f"{out / OPTIMIZER_FILE}: unreadable optimizer state ({str(bad).splitlines()[0]}); "
                          "cannot resume this run") from None
    for name, param in model.named_parameters():
        for kind in ("exp_avg", "exp_avg_sq"):
            moment = moments.get(f"{name}::{kind}")
            if moment is not None and moment.shape != param.shape:
                raise SpeedcError(f"{out / OPTIMIZER_FILE}: {name}::{kind} has shape {tuple(moment.shape)}, the "
                                  f"model's is {tuple(param.shape)}; cannot resume this run")
    return moments


def train(out: str | Path, opts: TrainOptions, *, resume: bool = False,
          progress: Callable[[int, int, dict], None] | None = None, given: frozenset[str] = frozenset()) -> dict:
    """Train (or resume) into OUT; returns the final training state (metrics included). GIVEN: the
    options the caller set explicitly (resuming checks them against the run's)."""
    out = Path(out)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.preset not in PRESETS:
        raise SpeedcError(f"unknown preset {opts.preset!r} (known: {', '.join(PRESETS)})")
    docs = load_documents(opts.corpus)
    digest = corpus_hash(docs)
    if resume:
        opts, state, tokenizer_json, model = _resumed_run(out, opts, given, digest)
    else:
        state, tokenizer_json, model = _new_run(out, opts, docs, digest)
    stream = TokenStream(docs, Tokenizer.from_str(tokenizer_json))
    state["corpus_tokens"] = {"train": len(stream.train), "val": len(stream.val)}
    optimizer = _optimizer(model, opts, out if resume else None, state)
    gen = torch.Generator().manual_seed(opts.seed + state["step"])
    started = time.time() - state["wall_seconds"]
    # Ctrl-C finishes the current step, saves, then stops: no work is lost.
    interrupted: list[int] = []
    previous_handler = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1)) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        _loop(out, model, optimizer, stream, opts, state, tokenizer_json, gen, started, progress, interrupted)
    finally:
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    if interrupted:
        raise KeyboardInterrupt
    if not state["history"] or state["history"][-1]["step"] != state["step"]:
        state["history"].append({"step": state["step"], "wall_seconds": state["wall_seconds"], **evaluate(model, stream, opts)})
        _save(out, model, optimizer, state, tokenizer_json)
    return state


def _resumed_run(out: Path, opts: TrainOptions, given: frozenset[str], digest: str):
    """(options, state, tokenizer.json text, model) of the run saved in OUT, checked against the corpus (DIGEST)
    and the options GIVEN now."""
    if not (out / STATE_FILE).exists():
        raise SpeedcError(f"{out}: nothing to resume (no {STATE_FILE})")
    state = _saved_state(out)
    if state["corpus_sha256"] != digest:
        raise SpeedcError(f"{out}: was trained on another corpus (sha256 {state['corpus_sha256'][:12]}…)")
    opts = _resumed_options(out, state["options"], opts, given)
    if opts.steps <= state["step"]:  # it printed "saved" and wrote nothing
        raise SpeedcError(f"{out}: the run is already at step {state['step']}; --steps is the new total, "
                          f"so give more than {state['step']}")
    try:
        tokenizer_json = (out / TOKENIZER_FILE).read_text()
    except (OSError, UnicodeDecodeError) as bad:
        raise SpeedcError(f"{out / TOKENIZER_FILE}: unreadable ({type(bad).__name__}); cannot resume this "
                          "run") from None
    cfg, tensors = load_checkpoint(out)
    return opts, state, tokenizer_json, model_from_state(cfg, tensors).train()


def _new_run(out: Path, opts: TrainOptions, docs, digest: str):
    """(state, tokenizer.json text, model) of a new run into OUT (empty or absent): a tokenizer trained on DOCS,
    the preset's model at its initial weights."""
    if (out / STATE_FILE).exists():
        raise SpeedcError(f"{out}: already holds a training run; pass --resume to continue it or choose another OUT")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # a checkpoint, an artifact, anything else
        raise SpeedcError(f"{out} exists and is not empty; train into a new folder (checkpoints there would be "
                          "written over)")
    preset = dict(PRESETS[opts.preset])
    if opts.seq_len > preset["max_position_embeddings"]:  # it trained, on windows the model's config disowns
        raise SpeedcError(f"--seq-len {opts.seq_len} is beyond the {opts.preset} preset's context of "
                          f"{preset['max_position_embeddings']} positions")
    tokenizer = train_tokenizer(docs, preset.pop("vocab_size"))
    cfg = read_config({
        "model_type": "llama", "vocab_size": tokenizer.get_vocab_size(),
        **{k: v for k, v in preset.items() if k not in ("layer_map", "exit_layer")},
        "speedc": {"layer_map": preset["layer_map"], "exit": {"layer": preset["exit_layer"], "norm": "own"}},
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
    })
    model = SharedLlama(cfg)
    _init_weights(model, cfg)
    state = {"step": 0, "corpus": opts.corpus, "corpus_sha256": digest, "options": asdict(opts),
             "wall_seconds": 0.0, "tokens_seen": 0, "history": []}
    return state, tokenizer.to_str(), model.train()


def _optimizer(model, opts: TrainOptions, resumed: Path | None, state: dict):
    """AdamW, weight decay on matrices only; RESUMED: with the moments saved in that run."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    if resumed is not None and (resumed / OPTIMIZER_FILE).exists():
        moments = _saved_moments(resumed, model)
        for name, param in model.named_parameters():
            if f"{name}::exp_avg" in moments:
                optimizer.state[param] = {"step": torch.tensor(state.get("adam_step", state["step"])),
                                          "exp_avg": moments[f"{name}::exp_avg"],
                                          "exp_avg_sq": moments[f"{name}::exp_avg_sq"]}
    return optimizer


def _loop(out, model, optimizer, stream, opts, state, tokenizer_json, gen, started, progress, interrupted) -> None:
    while state["step"] < opts.steps:
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, opts)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.bf16):
            final, early, _, _ = exit_losses(model, stream.batch("train", opts.batch_size, opts.seq_len, gen))
        loss = final + opts.exit_weight * early
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        state["step"] = step + 1
        state["tokens_seen"] += opts.batch_size * opts.seq_len
        state["wall_seconds"] = round(time.time() - started, 1)
        metrics: dict = {"loss_final": round(final.item(), 4), "loss_exit": round(early.item(), 4)}
        done = state["step"] == opts.steps
        if state["step"] % opts.eval_every == 0 or done:
            metrics.update(evaluate(model, stream, opts))
            state["history"].append({"step": state["step"], "wall_seconds": state["wall_seconds"], **metrics})
        if state["step"] % opts.save_every == 0 or done:
            _save(out, model, optimizer, state, tokenizer_json)
        if progress:
            progress(state["step"], opts.steps, metrics)
        if interrupted:
            _save(out, model, optimizer, state, tokenizer_json)
            return
