"""An artifact of another format version than this speedc writes (FORMAT_VERSION) is refused at every
entry that reads one, in one line asking for a rebuild: the CLI commands generate, inspect, bench,
serve and quality exit non-zero without a traceback, and Engine.load raises ArtifactError. Nothing
of such an artifact is trusted (its graphs' inputs, its manifest fields may mean something else).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_one_line_error, run_cli
from speedc.format.artifact import FORMAT_VERSION, MANIFEST
from speedc.errors import ArtifactError
from speedc.runtimes.engine import Engine

PREVIOUS = FORMAT_VERSION - 1  # the format before this one (1 once FORMAT_VERSION is 2)

ENTRIES = {  # command line after `speedc`, ART standing for the artifact
    "generate": ["generate", "ART", "--prompt", "hi", "--max-new-tokens", "2"],
    "inspect": ["inspect", "ART"],
    "bench": ["bench", "artifact", "ART", "--new-tokens", "2", "--repeats", "1", "--no-peers"],
    "bench-concurrency": ["bench", "concurrency", "ART", "--clients", "1", "--new-tokens", "2", "--repeats", "1", "--no-peers"],
    "serve": ["serve", "ART", "--port", "0"],
    "quality": ["quality", "ART", "ART"],
}


@pytest.fixture(scope="module", params=[PREVIOUS, FORMAT_VERSION + 1], ids=["previous", "newer"])
def other_version(request, tiny_artifact, tmp_path_factory) -> tuple[Path, int]:
    """A copy of the tiny artifact whose manifest says another format version (nothing else changed)."""
    art = Path(shutil.copytree(tiny_artifact, tmp_path_factory.mktemp("format") / "art"))
    manifest = json.loads((art / MANIFEST).read_text())
    manifest["format_version"] = request.param
    (art / MANIFEST).write_text(json.dumps(manifest))
    return art, request.param


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_asks_for_a_rebuild_in_one_line(other_version, entry):
    art, version = other_version
    result = run_cli(*(str(art) if word == "ART" else word for word in ENTRIES[entry]), timeout=120)
    assert_one_line_error(result, f"artifact format version {version}", f"reads version {FORMAT_VERSION}",
                          "rebuild it with `speedc build`")


def test_engine_load_refuses_it(other_version):
    art, version = other_version
    with pytest.raises(ArtifactError, match=rf"format version {version} but this speedc reads version "
                                            rf"{FORMAT_VERSION}; rebuild it") as refused:
        Engine.load(art)
    assert "\n" not in str(refused.value)


def test_the_current_version_still_loads(tiny_artifact):
    assert Engine.load(tiny_artifact).manifest.format_version == FORMAT_VERSION
