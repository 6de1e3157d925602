"""Where `speedc build` may write its artifact, and how a finished build takes its place.

    check_output(out, checkpoint, force)   before any work: refuse an OUT the build must never write
                                           over (the current directory, a folder holding the
                                           checkpoint, a file, a symbolic link, a folder that is not
                                           a speedc artifact) or, without --force, any existing OUT
    install(tmp, out, force)               at the end: the finished build TMP becomes OUT

Why: `--force` used to delete whatever OUT named (`-o .`, the checkpoint's parent, a folder of
notes) and replaced an old artifact by deleting it first, so a failure in between left neither.
Now --force replaces an artifact (a folder with manifest.json) or an empty folder only, and the old
one is renamed aside before the new one is renamed in: OUT is always one whole artifact or the other.
An OUT that appears while the build runs is never deleted: the new artifact is kept beside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from speedc.format.artifact import MANIFEST
from speedc.errors import BuildError


def replaceable(out: Path) -> bool:
    """An existing OUT that --force may replace: a speedc artifact (or an unfinished build of one:
    its manifest.json is written last) or an empty folder."""
    return out.is_dir() and not out.is_symlink() and ((out / MANIFEST).is_file() or not any(out.iterdir()))


def check_output(out: Path, checkpoint: Path, force: bool) -> None:
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:
        raise BuildError(f"-o {os.fsdecode(out)!r}: the name is not valid UTF-8 (ONNX needs UTF-8 paths)") from None
    resolved = out.resolve()
    if resolved == Path.cwd().resolve():
        raise BuildError("-o names the current directory; give the artifact a folder of its own")
    if resolved == checkpoint.resolve():
        raise BuildError("the output directory must differ from the checkpoint directory")
    if resolved in checkpoint.resolve().parents:
        raise BuildError(f"-o {out} holds the checkpoint {checkpoint}; writing the artifact there would replace it")
    if out.is_symlink():
        raise BuildError(f"{out} is a symbolic link; give the folder it points to, or another -o")
    if not out.exists():
        return
    if not force:
        raise BuildError(f"{out} exists; pass --force to replace it")
    if not out.is_dir():
        raise BuildError(f"{out} is a file; --force replaces an artifact folder only")
    if not replaceable(out):
        raise BuildError(f"{out} is not a speedc artifact (no {MANIFEST}) and not empty; --force replaces artifacts "
                         "only: choose another -o or remove it yourself")


def install(tmp: Path, out: Path, force: bool) -> None:
    """Make the finished build TMP the artifact OUT (TMP is a sibling of OUT: renames, no copies)."""
    if not (out.exists() or out.is_symlink()):
        os.rename(tmp, out)
        return
    if not (force and replaceable(out)):  # it appeared while the build ran (another build, a user's folder)
        kept = Path(tempfile.mkdtemp(prefix=f"{out.name}.built-", dir=out.parent))
        os.replace(tmp, kept)  # over the empty folder mkdtemp made: a free name
        raise BuildError(f"{out} appeared while the build ran and was left as it is; the new artifact is {kept}")
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))  # the old artifact goes in here
    os.rename(out, aside / out.name)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(aside / out.name, out)  # put the old artifact back
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)
