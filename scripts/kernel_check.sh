#!/usr/bin/env bash
# Kernel check: speedc's int4/int8 and 16-bit product kernel (runtimes/kernels/) on this CPU, for CPUs
# this project's machines may lack (AVX-VNNI, AVX-512 VNNI, AMX, Arm dotprod / i8mm): the paths it runs,
# every path's tests (exact integer sums, row and thread invariance, the reference, the portable path's
# bits; tests/numeric/test_block_product_kernel.py, test_half_product_kernel.py and, for the attention over
# the KV pool, test_attention_kernel.py),
# then each path's time for 1, 2, 4 and 8 rows over Ouro-1.4B's products beside MatMulNBits and the
# memory floor (speedc.bench.floor.measure_kernel, int4 and int8). Written to kernel_check.json (or
# $OUT/kernel_check.json) with the CPU's model and flags.
#
#   bash scripts/kernel_check.sh [LAYERS [THREADS]]     # default: all 24 layers, 2 threads
#
# Needs python with numpy, onnx, onnxruntime, pytest and hypothesis, and a C compiler; runs this checkout
# where speedc is not installed (scripts/checkout_python.sh).
set -euo pipefail
layers="${1:-24}"
threads="${2:-2}"
report="$(realpath -m "${OUT:-$(cd "$(dirname "$0")/.." && pwd)}/kernel_check.json")"
source "$(dirname "$0")/checkout_python.sh"
export SPEEDC_KERNEL_CACHE="$STAGE/kernels"
tests="$(mktemp)"
set +e
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider "$REPO/tests/numeric/test_block_product_kernel.py" \
    "$REPO/tests/numeric/test_half_product_kernel.py" "$REPO/tests/numeric/test_attention_kernel.py" >"$tests" 2>&1
passed=$?
set -e
tail -5 "$tests"
timeout 600 "$PYTHON" - "$report" "$layers" "$threads" "$passed" "$tests" <<'PY'
import json, platform, sys
from pathlib import Path

from speedc.bench.floor import measure_kernel
from speedc.bench.synthetic import SHAPES
from speedc.runtimes.kernels import native

report, layers, threads, status, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), platform.processor())
flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith(("flags", "Features"))), [])
kernel = native.load()
result = {"cpu": model, "machine": platform.machine(), "cpus": len([l for l in cpuinfo.splitlines() if l.startswith("processor")]),
          "flags": sorted(f for f in flags if any(k in f for k in ("avx", "vnni", "amx", "f16c", "asimddp", "i8mm", "fma"))),
          "paths": kernel.paths if kernel else None, "auto": kernel.path if kernel else native.unavailable_reason(),
          "tests_passed": status == 0, "tests": Path(log).read_text().strip().splitlines()[-3:], "layers": layers,
          "measured": {}}
for weights in ("int4", "int8"):
    result["measured"][weights] = measure_kernel(SHAPES["ouro-1.4b"], layers, weights=weights, threads=threads)
    print(weights, json.dumps({p: m["cost"] | {"1 row vs floor": m["one_row_vs_stream"]}
                               for p, m in result["measured"][weights].get("paths", {}).items()}), flush=True)
Path(report).write_text(json.dumps(result, indent=1) + "\n")
sys.exit(0 if status == 0 else 1)
PY
