"""`pip install speedc` without extras: commands that need an extra say which one in one line and
exit 1; running an artifact still works.

The environment is a venv whose site-packages holds links to only speedc and the closure of its base
dependencies (read from the installed metadata), so torch, onnx and the other extras are honestly not
importable there, and building it costs no pip install (test_no_torch_runtime.py does the real one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import ZOO, assert_one_line_error
from speedc.cli import EXTRA_FOR_MODULE, missing_module_message

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Installed distributions only: the repo's own speedc.egg-info (on sys.path under pytest) would
# otherwise stand in for the installed speedc and link the bare source folder.
SITE_PACKAGES = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})


def _base_closure() -> dict[str, metadata.Distribution]:
    """speedc and every distribution its base dependencies pull in (no extras anywhere)."""
    found: dict[str, metadata.Distribution] = {}
    todo = ["speedc", *PROJECT["dependencies"]]
    while todo:
        req = Requirement(todo.pop())
        key = canonicalize_name(req.name)
        if key in found or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        dist = next(iter(metadata.distributions(name=req.name, path=SITE_PACKAGES)), None)
        if dist is None:
            continue  # declared for another platform or Python, so not installed here either
        found[key] = dist
        todo.extend(dist.requires or [])
    return found


@pytest.fixture(scope="module")
def base_env(tmp_path_factory) -> Path:
    """A venv that sees only the base install; returns its `speedc` console script."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in _base_closure().values():
        # Top-level entries only (package dirs, modules, .dist-info, speedc's editable .pth and finder);
        # "../" entries are console scripts outside site-packages; __pycache__ is shared by all.
        for top in {f.parts[0] for f in dist.files or () if f.parts[0] not in ("..", "__pycache__")}:
            source, link = Path(dist.locate_file(top)), site / top
            if source.exists() and not link.exists():
                link.symlink_to(source)
    script = venv / "bin" / "speedc"
    script.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom speedc.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return script


def run_base(script: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(script), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


IMPORT_NAMES = {"pytest_xdist": "xdist", "llama_cpp_python": "llama_cpp"}  # distributions whose import name is not their project name


def test_extra_table_matches_pyproject():
    """Every package of every extra has its import name in the CLI's table, under that extra (the first
    extra that lists it: gguf is the peers extra's, and dev's for its tests)."""
    base = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    expected = {}
    for extra, reqs in PROJECT["optional-dependencies"].items():
        for req in map(Requirement, reqs):
            name = canonicalize_name(req.name)
            # speedc[...] is dev pulling in other extras; onnxruntime-gpu installs the base onnxruntime module.
            if name == "speedc" or name.replace("-gpu", "") in base:
                continue
            module = name.replace("-", "_")
            expected.setdefault(IMPORT_NAMES.get(module, module), extra)
    assert EXTRA_FOR_MODULE == expected


def test_missing_module_messages():
    known = missing_module_message("speedc build", ModuleNotFoundError("No module named 'onnx.helper'", name="onnx.helper"))
    assert known == "speedc build needs the compiler extra (onnx is not installed): pip install 'speedc[compiler]'"
    unknown = missing_module_message("speedc bench", ModuleNotFoundError("No module named 'foo'", name="foo"))
    assert unknown == "speedc bench needs the Python module foo, which is not installed"


def test_environment_has_only_the_base_install(base_env, tmp_path):
    python = str(base_env.with_name("python"))
    check = "import importlib.util as u, json, sys; print(json.dumps({m: u.find_spec(m) is not None for m in sys.argv[1:]}))"
    base_modules = ["numpy", "onnxruntime", "tokenizers", "click", "rich", "speedc.cli"]
    found = json.loads(subprocess.run([python, "-c", check, *EXTRA_FOR_MODULE, *base_modules], check=True,
                                      capture_output=True, text=True, cwd=tmp_path).stdout)
    assert {m for m, ok in found.items() if ok} == set(base_modules)


@pytest.mark.parametrize("command", [
    ["build", ZOO / "tiny", "-o", "{tmp}/X"],
    ["inspect", ZOO / "tiny"],
    ["train", "{tmp}/X", "--steps", "1"],
    ["bench", "memory-bound", "--json"],
], ids=lambda c: c[0] if c[0] != "bench" else "bench-memory-bound")
def test_commands_name_the_compiler_extra(base_env, tmp_path, command):
    args = [str(a).format(tmp=tmp_path) for a in command]
    result = run_base(base_env, *args, cwd=tmp_path)
    assert result.returncode == 1
    command_path = " ".join(args[:2]) if args[0] == "bench" else args[0]  # bench names its benchmark
    assert_one_line_error(result, f"speedc {command_path} needs the compiler extra", "pip install 'speedc[compiler]'")
    assert not (tmp_path / "X").exists()


def test_serve_names_the_serve_extra(base_env, tmp_path, tiny_artifact):
    result = run_base(base_env, "serve", tiny_artifact, "--port", "0", cwd=tmp_path)
    assert_one_line_error(result, "speedc serve needs the serve extra", "pip install 'speedc[serve]'")


def test_generate_runs_and_torch_backend_names_the_extra(base_env, tmp_path, tiny_artifact):
    result = run_base(base_env, "generate", tiny_artifact, "--prompt", "ROMEO:", "--max-new-tokens", "8", "--ignore-eos",
                      "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    from speedc import Engine

    expected = Engine.load(tiny_artifact).generate("ROMEO:", max_new_tokens=8, stop_at_eos=False).ids
    assert json.loads(result.stdout)["ids"] == expected

    torch_backend = run_base(base_env, "generate", tiny_artifact, "--prompt", "ROMEO:", "--backend", "torch", cwd=tmp_path)
    assert torch_backend.returncode == 1
    assert_one_line_error(torch_backend, "speedc[compiler]")
