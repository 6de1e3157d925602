"""Bundled models are named `zoo:NAME` on the command line, from any working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ZOO, assert_one_line_error, run_cli
from speedc.errors import CheckpointError
from speedc.models import zoo


def test_registry_lists_the_bundled_models():
    assert set(zoo.names()) >= {"tiny", "small"}
    assert zoo.resolve("zoo:tiny") == ZOO / "tiny"
    assert "8 layers over 2 shared blocks" in zoo.description("tiny")


def test_plain_paths_stay_paths(tmp_path):
    assert zoo.resolve(tmp_path / "ckpt") == tmp_path / "ckpt"
    assert zoo.resolve("some/dir") == Path("some/dir")


def test_old_bare_name_points_at_the_zoo_name(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no ./tiny here
    with pytest.raises(CheckpointError, match="zoo:tiny"):
        zoo.resolve("tiny")


def test_build_from_zoo_name_outside_the_repo(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # run_cli's subprocess inherits this cwd: nothing of the repo is relative to it
    result = run_cli("build", "zoo:tiny", "-o", "art", "--no-measure")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "art" / "manifest.json").is_file()


def test_unknown_zoo_name_lists_the_available_ones(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for command in ("build", "inspect"):
        result = run_cli(command, "zoo:nope", *(["-o", "art"] if command == "build" else []))
        assert result.returncode == 1
        assert_one_line_error(result, "zoo:nope", "zoo:tiny", "zoo:small")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("command", ["build", "inspect"])
def test_help_lists_the_bundled_models(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    assert "zoo:tiny" in result.stdout and "zoo:small" in result.stdout
