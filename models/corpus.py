"""Training text that needs no hub: the bundled Shakespeare corpus, the Python standard library's own
source, or the user's text files."""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from pathlib import Path

from speedc.errors import SpeedcError

DATA_DIR = Path(__file__).resolve().parent / "data"
DOC_SEPARATOR = "\n<|endoftext|>\n"


def _shakespeare() -> list[str]:
    text = gzip.decompress((DATA_DIR / "shakespeare.txt.gz").read_bytes()).decode("utf-8")
    return [doc for doc in text.split(DOC_SEPARATOR) if doc.strip()]


def _stdlib() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


BUNDLED_CORPORA = {"shakespeare": _shakespeare, "stdlib": _stdlib}


def load_documents(sources: list[str]) -> list[str]:
    """Each source is a bundled corpus name, a text file, or a folder of .txt files."""
    docs: list[str] = []
    for source in sources:
        if source in BUNDLED_CORPORA:
            docs.extend(BUNDLED_CORPORA[source]())
            continue
        path = Path(source)
        if path.is_dir():
            files = sorted(path.rglob("*.txt"))
            if not files:
                raise SpeedcError(f"{path}: folder has no .txt files")
        elif path.is_file():
            files = [path]
        else:
            known = ", ".join(BUNDLED_CORPORA)
            raise SpeedcError(f"{source}: not a file, a folder, or a bundled corpus ({known})")
        for file in files:
            try:
                docs.append(file.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                raise SpeedcError(f"{file}: not UTF-8 text") from None
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise SpeedcError("the corpus is empty")
    return docs


def corpus_hash(docs: list[str]) -> str:
    return hashlib.sha256(DOC_SEPARATOR.join(docs).encode("utf-8")).hexdigest()
