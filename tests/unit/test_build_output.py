"""Where `speedc build` writes (speedc/build_output.py): an OUT it must never write over is refused
before any work, --force replaces only an artifact or an empty folder, and a finished build takes
OUT's place by renames, so OUT is always one whole artifact or the other, and a folder that appears
while the build runs is never deleted. Before, --force deleted whatever OUT named (the checkpoint's
parent folder, `-o .`) and deleted an old artifact before the new one was in place."""

from __future__ import annotations

import os
import shutil

import pytest

from conftest import ZOO, assert_one_line_error, run_cli
from speedc.format.artifact import MANIFEST
from speedc.build_output import check_output, install
from speedc.errors import BuildError


@pytest.fixture()
def checkpoint(tmp_path):
    return shutil.copytree(ZOO / "tiny", tmp_path / "parent" / "ckpt")


@pytest.mark.parametrize("name, prepare, force, message", [
    ("parent", lambda tmp: None, True, "holds the checkpoint"),
    ("notes", lambda tmp: (tmp / "notes").mkdir() or (tmp / "notes" / "precious.txt").write_text("keep"), True,
     "is not a speedc artifact"),
    ("file", lambda tmp: (tmp / "file").write_text("keep"), True, "is a file"),
    ("link", lambda tmp: (tmp / "elsewhere").mkdir() or os.symlink(tmp / "elsewhere", tmp / "link"), True,
     "is a symbolic link"),
    ("old", lambda tmp: (tmp / "old").mkdir() or (tmp / "old" / MANIFEST).write_text("{}"), False,
     "exists; pass --force"),
])
def test_outputs_the_build_must_not_write_over_are_refused(checkpoint, tmp_path, name, prepare, force, message):
    out = checkpoint.parent if name == "parent" else tmp_path / name
    prepare(tmp_path)
    with pytest.raises(BuildError, match=message):
        check_output(out, checkpoint, force)


def test_force_replaces_an_artifact_or_an_empty_folder(checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", checkpoint, True)
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / MANIFEST).write_text("{}")
    check_output(tmp_path / "art", checkpoint, True)
    check_output(tmp_path / "new", checkpoint, False)


def test_the_current_directory_is_refused_and_nothing_in_it_is_touched(tmp_path):
    (tmp_path / "keep.txt").write_text("keep")
    result = run_cli("build", "zoo:tiny", "-o", ".", "--force", cwd=tmp_path)
    assert_one_line_error(result, "-o names the current directory")
    assert (tmp_path / "keep.txt").read_text() == "keep"


def _finished_build(tmp_path, text: str):
    tmp = tmp_path / f".out.partial-{text}"
    tmp.mkdir()
    (tmp / MANIFEST).write_text(text)
    return tmp


def test_install_renames_the_old_artifact_aside_before_the_new_one_in(tmp_path):
    out = tmp_path / "out"
    install(_finished_build(tmp_path, "first"), out, force=False)
    assert (out / MANIFEST).read_text() == "first"
    install(_finished_build(tmp_path, "second"), out, force=True)
    assert (out / MANIFEST).read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one and the build folder are gone


def test_install_puts_the_old_artifact_back_when_the_new_one_cannot_move_in(tmp_path):
    out = tmp_path / "out"
    install(_finished_build(tmp_path, "old"), out, force=False)
    missing = tmp_path / "gone"  # a build folder that vanished: its rename fails after the old one moved aside
    with pytest.raises(OSError):
        install(missing, out, force=True)
    assert (out / MANIFEST).read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_that_appeared_during_the_build_is_kept_and_so_is_the_new_artifact(tmp_path, force):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("important")  # made by hand while the build ran
    with pytest.raises(BuildError, match="appeared while the build ran") as refused:
        install(_finished_build(tmp_path, "new"), out, force=force)
    assert (out / "notes.txt").read_text() == "important"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("out.built-")]
    assert len(kept) == 1 and (kept[0] / MANIFEST).read_text() == "new" and str(kept[0]) in str(refused.value)


def test_a_real_forced_rebuild_replaces_the_artifact(tmp_path):
    out = tmp_path / "art"
    assert run_cli("build", "zoo:tiny", "-o", out).returncode == 0
    first = (out / MANIFEST).stat().st_mtime_ns
    result = run_cli("build", "zoo:tiny", "-o", out, "--force")
    assert result.returncode == 0, result.stderr
    assert (out / MANIFEST).stat().st_mtime_ns != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_sigterm_during_a_build_leaves_nothing_behind(tmp_path):
    """Before: SIGTERM killed the build without its cleanup, leaving a hidden .NAME.partial-* folder."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    exe = Path(sys.executable).with_name("speedc")
    build = subprocess.Popen([str(exe), "build", "zoo:small", "-o", str(tmp_path / "small"), "--no-measure"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".small.partial-") for p in tmp_path.iterdir()):  # the build is writing
        assert build.poll() is None and time.monotonic() < deadline, build.communicate()
        time.sleep(0.05)
    build.send_signal(signal.SIGTERM)
    _, stderr = build.communicate(timeout=60)
    assert build.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    assert list(tmp_path.iterdir()) == []
