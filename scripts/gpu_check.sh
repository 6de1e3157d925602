#!/usr/bin/env bash
# GPU check: lossless + speed vs autoregressive for every GPU backend installed, in under 8 minutes,
# written to gpu_check.json (or $OUT/gpu_check.json when OUT is set, as on the device machine).
#
#   bash scripts/gpu_check.sh [--hidden 2048 --blocks 6 ...]   # on a machine with an NVIDIA GPU
#
# Needs python with torch (CUDA) and numpy; nothing is installed into site-packages but the wheels
# carried in .whl/ (onnxruntime-gpu, say). Runs this checkout where speedc is not installed
# (scripts/checkout_python.sh).
set -euo pipefail
report="$(realpath -m "${OUT:-$(cd "$(dirname "$0")/.." && pwd)}/gpu_check.json")"
source "$(dirname "$0")/checkout_python.sh"
timeout 480 "$PYTHON" -m speedc.gpu_check --out "$report" "$@"
