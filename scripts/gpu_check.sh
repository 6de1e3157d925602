#!/usr/bin/env bash
# GPU check: lossless + speed vs autoregressive for every GPU backend installed, in under 8 minutes,
# written to gpu_check.json (or $OUT/gpu_check.json when OUT is set, as on the device machine).
#
#   bash scripts/gpu_check.sh [--hidden 2048 --blocks 6 ...]   # on a machine with an NVIDIA GPU
#
# Needs python with torch (CUDA) and numpy; nothing is installed into site-packages. Where speedc is
# not installed, this checkout is made importable through a staging folder of symlinks (the source
# folders map onto speedc, speedc.models, speedc.passes, speedc.runtimes as pyproject.toml does).
# Wheels carried in .whl/ (onnxruntime-gpu, say) are installed first when present.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac  # absolute, venv kept
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --find-links .whl .whl/*.whl
fi
repo="$PWD"
report="$(realpath -m "${OUT:-$repo}/gpu_check.json")"
stage="$(mktemp -d)"  # also the working directory, so that ./speedc of the checkout never shadows it
trap 'rm -rf "$stage"' EXIT
cd "$stage"
if ! "$PYTHON" -c "import speedc.models.llama, speedc.runtimes.decode" 2>/dev/null; then
    mkdir speedc
    for entry in "$repo"/speedc/*; do ln -s "$entry" speedc/; done
    for package in models passes runtimes; do ln -s "$repo/$package" "speedc/$package"; done
    export PYTHONPATH="$stage${PYTHONPATH:+:$PYTHONPATH}"
fi
timeout 480 "$PYTHON" -m speedc.gpu_check --out "$report" "$@"
