"""lm-evaluation-harness against `speedc serve`: its `local-completions` model (echo + logprobs over
/v1/completions) scores a multiple-choice task and a perplexity task on local data (no downloads) the
same as lm-eval's Hugging Face backend on the same checkpoint (zoo:tiny saved as a transformers Llama):
every sample's log-likelihood within 1e-4, the metrics within rounding."""

from __future__ import annotations

import json
import random
import shutil
import signal

import pytest

from conftest import ZOO
from serve_server import start_server

lm_eval = pytest.importorskip("lm_eval")

TASKS = """task: speedc_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PERPLEXITY = """task: speedc_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/text.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{{{text}}}}"
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
NAMES = ["ROMEO", "JULIET", "HAMLET", "KING HENRY", "MERCUTIO", "OPHELIA", "FALSTAFF", "BRUTUS"]
LINES = ["ROMEO:\nBut soft, what light through yonder window breaks?", "JULIET:\nO Romeo, Romeo, wherefore art thou?",
         "KING HENRY:\nOnce more unto the breach, dear friends, once more.", "HAMLET:\nTo be, or not to be."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_artifact, monkeypatch_module):
    from speedc.models.checkpoint.torch_io import load_model, save_unrolled_hf

    root = tmp_path_factory.mktemp("lm-eval")
    hf = save_unrolled_hf(load_model(ZOO / "tiny"), root / "hf")
    shutil.copy(ZOO / "tiny" / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": "<|endoftext|>", "model_max_length": 256}))
    rng = random.Random(0)
    with open(root / "mc.jsonl", "w") as data:
        for _ in range(12):
            who = rng.sample(NAMES, 3)
            data.write(json.dumps({"question": f"{who[0]}:\nWhat news, my lord? Who comes", "answer": rng.randrange(3),
                                   "choices": [f" {name.lower()}" for name in who]}) + "\n")
    (root / "text.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in LINES))
    (root / "speedc_mc.yaml").write_text(TASKS.format(data=root))
    (root / "speedc_ppl.yaml").write_text(PERPLEXITY.format(data=root))
    return root, hf


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            patch.setenv(name, "1")  # local data and checkpoint only
        yield patch


def _evaluate(model: str, model_args: str, root, **options) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["speedc_mc", "speedc_ppl"],
                                   task_manager=TaskManager(include_path=str(root)), log_samples=True, **options)


def test_local_completions_scores_equal_the_hugging_face_backend(setup, tiny_artifact, tmp_path):
    root, hf = setup
    reference = _evaluate("hf", f"pretrained={hf},dtype=float32", root, batch_size=1, device="cpu")
    running = start_server(tiny_artifact, tmp_path, "--model-name", "tiny")
    try:
        served = _evaluate("local-completions", f"model=tiny,base_url={running.url}/v1/completions,tokenizer={hf},"
                                                "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1", root)
    finally:
        assert running.stop() == -signal.SIGTERM, running.log.read_text()
    for task in ("speedc_mc", "speedc_ppl"):
        ours = [r for sample in served["samples"][task] for r in sample["resps"]]
        theirs = [r for sample in reference["samples"][task] for r in sample["resps"]]
        assert len(ours) == len(theirs) > 0
        for mine, expected in zip(ours, theirs):
            value, expected_value = (mine[0], expected[0]) if task == "speedc_mc" else (mine, expected)
            value = value[0] if isinstance(value, (list, tuple)) else value
            expected_value = expected_value[0] if isinstance(expected_value, (list, tuple)) else expected_value
            assert abs(value - expected_value) < 1e-4, (task, mine, expected)
        for metric, number in reference["results"][task].items():
            if isinstance(number, float):
                assert served["results"][task][metric] == pytest.approx(number, rel=1e-5, abs=1e-6), (task, metric)
