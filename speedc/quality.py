"""`speedc quality`: what a storage precision costs in quality, measured, against a reference artifact.

Quantized weights (--weights int8/int4) change the model: SPEED stays lossless to the artifact it runs
(its output equals plain decoding of the same artifact), but that artifact is not the fp32 model.
This reports, for each artifact beside the reference (normally the fp32 build of the same checkpoint):

    validation loss        mean next-token cross-entropy over held-out text (plain decoding, one
                           position at a time, so every position sees the same graph as decoding does)
    top-1 agreement        on the same text: the fraction of positions whose most likely next token
                           equals the reference artifact's (teacher-forced: no error compounding)
    greedy agreement       greedy continuations of the prompts, position by position, vs the reference's
                           (after a first divergence the texts differ, so this compounds), and how many
                           continuations are identical
    SPEED acceptance       exit/final agreement as SPEED sees it while decoding the prompts greedily

Runs on the ONNX Runtime backend (numpy, onnxruntime, tokenizers only).
"""

from __future__ import annotations

import gzip
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from speedc.errors import SpeedcError

DEFAULT_PROMPTS = ("ROMEO:", "First Citizen:\nWe are", "KING HENRY:\nNow", "To be, or not", "JULIET:\nO")


@dataclass
class Quality:
    artifact: str
    dtype: str
    stored_bytes: int
    val_loss: float
    top1_agreement: float  # with the reference, teacher-forced on the validation text
    greedy_agreement: float  # with the reference's greedy continuations, position by position
    identical_continuations: int
    continuations: int
    speed_acceptance: float
    val_tokens: int


def validation_ids(engine, tokens: int, text: str | None = None) -> list[int]:
    """The last TOKENS tokens of TEXT (default: the bundled Shakespeare corpus, whose tail is the zoo
    models' validation split: training holds out the last 2% of the token stream)."""
    if text is None:
        from speedc.models.corpus import DATA_DIR  # standard library only

        text = gzip.decompress((DATA_DIR / "shakespeare.txt.gz").read_bytes()).decode("utf-8")[-40 * tokens:]
    ids = engine.encode(text)
    if len(ids) < tokens + 1:
        raise SpeedcError(f"the validation text has {len(ids)} tokens; {tokens + 1} needed")
    return ids[-(tokens + 1):]


def teacher_forced(engine, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax [T], log-probability of the true next token [T]) at each position of IDS, by plain decoding."""
    backend = engine.backend
    backend.reserve(len(ids) + 1, 1)
    argmax, true_logprob = [], []
    for position, token in enumerate(ids[:-1]):
        top, logits = backend.prefill(0, [[token]], position, True)  # pool row 0: [1], [1, V]
        row = np.asarray(logits[0], np.float64)
        shifted = row - row.max()
        argmax.append(int(top[0]))
        true_logprob.append(shifted[ids[position + 1]] - np.log(np.exp(shifted).sum()))
    return np.array(argmax), np.array(true_logprob)


def greedy(engine, prompts: list[str], new_tokens: int) -> tuple[list[list[int]], float]:
    """(greedy continuation ids per prompt, SPEED acceptance over them); SPEED's ids are plain decoding's."""
    from speedc.runtimes.decode import pooled_acceptance

    results = [engine.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False) for prompt in prompts]
    return [r.ids for r in results], pooled_acceptance(r.stats for r in results)


def compare(reference: Path, artifacts: list[Path], *, prompts: list[str] | None = None, new_tokens: int = 64,
            val_tokens: int = 256, text: str | None = None, threads: int | None = None,
            progress=lambda message: None) -> list[Quality]:
    """Quality of the REFERENCE and each of ARTIFACTS, all measured the same way (the reference's own
    agreements are 1 by definition: a check that the measurement is deterministic)."""
    from speedc import Engine
    from speedc.bench.run import Agreement

    prompts = list(prompts or DEFAULT_PROMPTS)
    rows, ref = [], None
    for path in [reference, *artifacts]:
        progress(f"{path}: validation loss and agreement")
        engine = Engine.load(path, threads=threads)
        if engine.tokenizer is None:
            raise SpeedcError(f"{path}: no tokenizer.json; quality needs text")
        ids = validation_ids(engine, min(val_tokens, engine.manifest.dims.max_context - 2), text)
        argmax, logprob = teacher_forced(engine, ids)
        outs, acceptance = greedy(engine, prompts, new_tokens)
        if ref is None:
            ref = (ids, argmax, outs)
        elif ids != ref[0]:
            raise SpeedcError(f"{path} tokenizes the validation text differently from {reference}: not the same model")
        agreement = Agreement(same_weights=False)  # each continuation against the reference's
        for out, ref_out in zip(outs, ref[2]):
            agreement.add(out, ref_out)
        rows.append(Quality(
            artifact=str(path), dtype=engine.manifest.dtype, stored_bytes=engine.manifest.store.stored_bytes,
            val_loss=round(float(-logprob.mean()), 4), top1_agreement=round(float((argmax == ref[1]).mean()), 4),
            greedy_agreement=agreement.to_json()["agreement"],
            identical_continuations=agreement.identical_runs, continuations=len(outs),
            speed_acceptance=round(acceptance, 4), val_tokens=len(ids) - 1))
    return rows


def to_json(rows: list[Quality]) -> dict:
    return {"reference": rows[0].artifact, "rows": [asdict(r) for r in rows]}
