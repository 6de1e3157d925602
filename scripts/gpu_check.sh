#!/usr/bin/env bash
# GPU check: lossless + speed vs autoregressive for every GPU backend installed, in under 8 minutes,
# written to gpu_check.json (or $OUT/gpu_check.json when OUT is set, as on the device machine).
#
#   bash scripts/gpu_check.sh                 # on a machine with an NVIDIA GPU and torch with CUDA
#
# Where speedc is not installed (a bare machine with torch), it installs this checkout without
# dependencies, plus any wheels carried in .whl/ (numpy and torch are all the torch check needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import speedc.gpu_check" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --find-links .whl .whl/*.whl
    fi
    "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .
fi
report="${OUT:-.}/gpu_check.json"
timeout 480 "$PYTHON" -m speedc.gpu_check --out "$report" "$@"
