#!/usr/bin/env bash
# Arm check: `speedc generate` on aarch64 Linux, emulated with qemu-user on an x86 host, on an int4
# artifact of the bundled zoo:tiny with its products on speedc's kernel (runtimes/kernels/) on each Arm
# path: i8mm (the widest under `qemu-aarch64 -cpu max`, SPEEDC_NATIVE_KERNEL=1), dotprod and portable.
# Each path decodes `--prompt ROMEO: --ignore-eos` with --mode speed and --mode autoregressive, greedy
# and --temperature 0.8 --seed 1, as does this x86 host with SPEEDC_NATIVE_KERNEL=portable. Then the
# logits of the prompt and of 8 plain steps (over x86's greedy ids) are compared bit for bit on each
# machine and path. Prints each run (the products' kernel path as `generate --json` reports it, seconds,
# tokens/s) and the comparisons, and writes them to arm_check.json in the work folder (or $OUT).
# Exit status: 0 all equal; 1 SPEED != plain somewhere, an Arm kernel path's ids or logits != the Arm
# portable path's, a run failed or its products did not run on the asked-for path; 3 only the Arm ids
# differ from x86's (ONNX Runtime's own fp32 ops need not give the same bits on both: the logits
# comparison shows by how much); 2 something it needs cannot be had (said in one line).
#
#   bash scripts/arm_check.sh [NEW_TOKENS]      # default 48 new tokens per run
#
# Needs, on the x86 host: qemu-aarch64 (Debian qemu-user), aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu:
# the emulated Python builds the kernel with it, CC=aarch64-linux-gnu-gcc, the compiler running natively),
# apt-get and dpkg-deb (the arm64 .debs of Debian bookworm's python3.11 and the libraries it needs, down to
# libc6, are downloaded with a private apt state and unpacked into a sysroot run with QEMU_LD_PREFIX: the
# system's own Python and dpkg database are never touched; root is not needed), pip with PyPI reachable
# (the aarch64 wheels of numpy, onnxruntime, onnxruntime-extensions, tokenizers, click, rich at the
# versions $PYTHON has, installed with --target), and $PYTHON (default: the checkout's .venv, else
# python3) with speedc's runtime and compiler dependencies to build the artifact. This checkout is what
# runs, on both sides. Work folder: $ARM_CHECK_DIR (default ~/.cache/speedc/arm_check), kept: the
# downloads (15 MB of .debs, 60 MB of wheels) are reused by later runs.
# The same logits of an fp32 build of zoo:tiny (ONNX Runtime's ops alone) show whether those agree.
# Takes 3.5-5 minutes on 2 shared x86 cores (about 20 s of it the downloads and unpacking, the first
# time): each emulated run is 10-20 s, mostly starting Python and ONNX Runtime under emulation.
set -euo pipefail
new_tokens="${1:-48}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}"
WORK="$(realpath -m "${ARM_CHECK_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/speedc/arm_check}")"
REPORT="$(realpath -m "${OUT:-$WORK}/arm_check.json")"
DEBIAN="${ARM_CHECK_DEBIAN:-http://deb.debian.org/debian}"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

need() { echo "arm_check: $*" >&2; exit 2; }
for tool in qemu-aarch64 aarch64-linux-gnu-gcc apt-get dpkg-deb; do
    command -v "$tool" >/dev/null || need "$tool is not installed (see the top of $0)"
done
[ -r "$KEYRING" ] || need "$KEYRING is missing (package debian-archive-keyring)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || need "$PYTHON has no pip"
mkdir -p "$WORK" "$(dirname "$REPORT")"
log="$WORK/last.log"
: >"$log"

# --- the arm64 Python sysroot: Debian bookworm's python3.11 and what it links, unpacked -------------
SYSROOT="$WORK/sysroot"
PACKAGES="python3.11-minimal libpython3.11-stdlib libstdc++6 libgcc-s1"
if [ ! -x "$SYSROOT/usr/bin/python3.11" ]; then
    apt_dir="$WORK/apt"
    mkdir -p "$apt_dir/state/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/none"
    : >"$apt_dir/status"  # an empty dpkg database: every dependency down to libc6 is downloaded
    {
        echo "deb [arch=arm64 signed-by=$KEYRING] $DEBIAN bookworm main"
        echo "deb [arch=arm64 signed-by=$KEYRING] ${DEBIAN%/debian}/debian-security bookworm-security main"
    } >"$apt_dir/sources.list"
    apt=(apt-get -q -o "Dir::State=$apt_dir/state" -o "Dir::State::status=$apt_dir/status"
         -o "Dir::Cache=$apt_dir/cache" -o "Dir::Etc::SourceList=$apt_dir/sources.list"
         -o "Dir::Etc::SourceParts=$apt_dir/none" -o "Dir::Etc::Preferences=$apt_dir/preferences"
         -o "Dir::Etc::PreferencesParts=$apt_dir/none" -o APT::Architecture=arm64 -o "APT::Architectures::=arm64"
         -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
    "${apt[@]}" update >>"$log" 2>&1 || need "apt-get update of Debian bookworm arm64 failed ($log)"
    # shellcheck disable=SC2086
    "${apt[@]}" install -y --download-only --no-install-recommends $PACKAGES >>"$log" 2>&1 \
        || need "cannot download the arm64 packages $PACKAGES and their dependencies ($log)"
    rm -rf "$SYSROOT.partial"
    for deb in "$apt_dir"/cache/archives/*.deb; do
        dpkg-deb -x "$deb" "$SYSROOT.partial" || need "cannot unpack $deb"
    done
    mv "$SYSROOT.partial" "$SYSROOT"
fi
export QEMU_LD_PREFIX="$SYSROOT" QEMU_CPU="${QEMU_CPU:-max}"
ARM_PYTHON=(qemu-aarch64 "$SYSROOT/usr/bin/python3.11")
"${ARM_PYTHON[@]}" -c "import ctypes, platform; assert platform.machine() == 'aarch64'" 2>>"$log" \
    || need "the arm64 python3.11 does not run under qemu-aarch64 ($log)"

# --- the aarch64 wheels, at the versions the x86 side runs ------------------------------------------
pins="$("$PYTHON" - <<'PY'
from importlib.metadata import PackageNotFoundError, version
for name in ("numpy", "onnxruntime", "onnxruntime-extensions", "tokenizers", "click", "rich"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)" || need "$PYTHON cannot run"
SITE="$WORK/site-$(echo "$pins" | sha256sum | cut -c1-12)"
if [ ! -d "$SITE" ]; then
    platform=(--only-binary=:all: --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64
              --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp)
    # shellcheck disable=SC2086
    for pin in $pins; do  # one at a time: a failure names its package
        "$PYTHON" -m pip download -q "${platform[@]}" -d "$WORK/wheels" "$pin" >>"$log" 2>&1 \
            || need "no aarch64 wheel of $pin for CPython 3.11 could be downloaded ($log)"
    done
    rm -rf "$SITE.partial"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q --no-index --find-links "$WORK/wheels" --target "$SITE.partial" "${platform[@]}" $pins \
        >>"$log" 2>&1 || need "cannot install the aarch64 wheels into $SITE ($log)"
    mv "$SITE.partial" "$SITE"
fi

# --- this checkout as the speedc package, for both sides (pyproject.toml's package-dir mapping) -----
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir "$STAGE/speedc"
for entry in "$REPO"/speedc/*; do ln -s "$entry" "$STAGE/speedc/"; done
for package in models passes runtimes; do ln -s "$REPO/$package" "$STAGE/speedc/$package"; done
# The logits of the prompt and of plain steps over given ids: whether they agree bit for bit across
# machines and kernel paths (the ids alone hide differences in the last bits).
cat >"$STAGE/arm_check_logits.py" <<'PY'
import sys

import numpy as np

from speedc.runtimes.engine import Engine

artifact, out, ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
engine = Engine.load(artifact, threads=2)
backend, prompt = engine.backend, engine.encode("ROMEO:")
backend.reserve(len(prompt) + len(ids), 1)
rows = [backend.prefill(0, [prompt], 0, True)[1][0].copy()]  # copies: the step's output buffer is reused
for step, token in enumerate(ids):
    rows.append(backend.plain_step(np.array([token]), np.array([len(prompt) + step]), np.array([True]), True)[1][0].copy())
np.save(out, np.stack(rows))
print(backend.products)
PY
ARTIFACT="$WORK/tiny-int4"
(cd "$STAGE" && PYTHONPATH="$STAGE" "$PYTHON" -m speedc.cli build zoo:tiny -o "$ARTIFACT" --weights int4 --no-measure --force) >>"$log" 2>&1 \
    || need "speedc build zoo:tiny --weights int4 failed on x86 ($log)"
FP32="$WORK/tiny-fp32"  # no kernel, no quantization: ONNX Runtime's ops alone, for the logits comparison
(cd "$STAGE" && PYTHONPATH="$STAGE" "$PYTHON" -m speedc.cli build zoo:tiny -o "$FP32" --no-measure --force) >>"$log" 2>&1 \
    || need "speedc build zoo:tiny (fp32) failed on x86 ($log)"

# --- the runs and the comparison --------------------------------------------------------------------
export ARM_CHECK_STAGE="$STAGE" ARM_CHECK_SITE="$SITE" ARM_CHECK_WORK="$WORK" ARM_CHECK_ARTIFACT="$ARTIFACT" \
    ARM_CHECK_FP32="$FP32"
"$PYTHON" - "$REPORT" "$new_tokens" "$SYSROOT/usr/bin/python3.11" <<'PY'
import json, os, platform, subprocess, sys, time

import numpy as np

report, new_tokens, arm_python = sys.argv[1], int(sys.argv[2]), sys.argv[3]
stage, site, work, artifact, fp32 = (os.environ[f"ARM_CHECK_{k}"] for k in ("STAGE", "SITE", "WORK", "ARTIFACT", "FP32"))
SAMPLINGS = {"greedy": [], "sampled": ["--temperature", "0.8", "--seed", "1"]}
MODES = ("speed", "autoregressive")
RUNS = [("x86_64", "portable"), ("aarch64", "1"), ("aarch64", "dotprod"), ("aarch64", "portable")]
LOGIT_STEPS = 8  # plain steps after the prompt whose logits are compared


def run(machine, path, arguments):
    """(exit status, stdout, last line of stderr, seconds) of this checkout's Python on MACHINE with the
    products on kernel PATH (SPEEDC_NATIVE_KERNEL; 1: the widest this CPU has)."""
    env = dict(os.environ, SPEEDC_NATIVE_KERNEL=path, PYTHONDONTWRITEBYTECODE="1",
               SPEEDC_KERNEL_CACHE=os.path.join(work, f"kernels-{machine}"))
    if machine == "aarch64":
        env.update(PYTHONPATH=f"{stage}:{site}", CC="aarch64-linux-gnu-gcc", PYTHONNOUSERSITE="1")
        command = ["qemu-aarch64", arm_python]
    else:
        env.update(PYTHONPATH=stage)
        command = [sys.executable]
    start = time.perf_counter()
    done = subprocess.run(command + arguments, env=env, cwd=stage, capture_output=True, text=True, timeout=600)  # not ./speedc
    last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return done.returncode, done.stdout, last, round(time.perf_counter() - start, 2)


def wanted(path):
    return "i8mm" if path == "1" else path  # qemu -cpu max has i8mm: the widest Arm path


results, failures, differences = {}, [], []
for machine, path in RUNS:
    for sampling in SAMPLINGS:
        for mode in MODES:
            key = f"{machine} {path} {mode} {sampling}"
            status, out, err, seconds = run(machine, path, [
                "-m", "speedc.cli", "generate", artifact, "--prompt", "ROMEO:", "--max-new-tokens", str(new_tokens),
                "--ignore-eos", "--json", "--threads", "2", "--mode", mode, *SAMPLINGS[sampling]])
            if status != 0:
                results[key] = {"error": err, "seconds": seconds}
                failures.append(f"{key}: failed: {err}")
                print(f"{key:40s} FAILED: {err}", flush=True)
                continue
            data = json.loads(out)
            r = results[key] = {"ids": data["ids"], "products": data.get("products"), "seconds": seconds,
                                "tokens_per_second": data["stats"]["decode_tokens_per_second"],
                                "acceptance": data["stats"]["acceptance_rate"]}
            if not (r["products"] or "").startswith(f"speedc kernel ({wanted(path)},"):
                failures.append(f"{key}: the products ran on {r['products']!r}, not the kernel's {wanted(path)} path")
            print(f"{key:40s} {r['products']:36s} {seconds:6.2f} s  {r['tokens_per_second']} tokens/s"
                  f"  acceptance {r['acceptance']}", flush=True)

print()
comparisons = {}
speed_ids = {(m, p, s): results[f"{m} {p} speed {s}"].get("ids") for m, p in RUNS for s in SAMPLINGS}
for machine, path in RUNS:
    for sampling in SAMPLINGS:
        speed = speed_ids[machine, path, sampling]
        plain = results[f"{machine} {path} autoregressive {sampling}"].get("ids")
        label = f"{machine} {path} {sampling}"
        checks = {"SPEED == plain": speed is not None and speed == plain}
        if machine == "aarch64":
            checks["== aarch64 portable"] = speed is not None and speed == speed_ids["aarch64", "portable", sampling]
            cross = speed is not None and speed == speed_ids["x86_64", "portable", sampling]
            if not cross:
                differences.append(f"{label}: ids differ from x86 portable's")
        comparisons[label] = checks | ({"== x86 portable": cross} if machine == "aarch64" else {})
        print(f"{label:32s} " + "  ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in comparisons[label].items()))
        failures += [f"{label}: not {name}" for name, ok in checks.items() if not ok]

# The logits of the prompt and LOGIT_STEPS plain steps over x86's greedy ids, on each machine and path.
print()
greedy = (speed_ids["x86_64", "portable", "greedy"] or [])[:LOGIT_STEPS]
logits = {}
for machine, path in RUNS:
    out = os.path.join(work, f"logits-{machine}-{wanted(path)}.npy")
    status, products, err, seconds = run(machine, path, [os.path.join(stage, "arm_check_logits.py"), artifact, out,
                                                         ",".join(map(str, greedy))])
    if status != 0 or not greedy:
        failures.append(f"logits {machine} {path}: failed: {err}")
        continue
    logits[machine, wanted(path)] = np.load(out)
reference = logits.get(("x86_64", "portable"))
logit_report = {}
for (machine, path), values in logits.items():
    if machine == "x86_64":
        continue
    arm_portable = logits.get(("aarch64", "portable"))
    same_arm = arm_portable is not None and np.array_equal(values.view(np.uint32), arm_portable.view(np.uint32))
    same_x86 = reference is not None and np.array_equal(values.view(np.uint32), reference.view(np.uint32))
    gap = float(np.abs(values - reference).max()) if reference is not None else None
    rows = int((values != reference).any(axis=1).sum()) if reference is not None else None
    logit_report[f"aarch64 {path}"] = {"bitwise == aarch64 portable": same_arm, "bitwise == x86 portable": same_x86,
                                       "max |difference| vs x86": gap, "rows differing vs x86": rows,
                                       "rows": len(values)}
    print(f"logits aarch64 {path:9s} bitwise == aarch64 portable: {'yes' if same_arm else 'NO'}  "
          f"bitwise == x86 portable: {'yes' if same_x86 else 'no'} (max |difference| {gap:.3g}, "
          f"{rows} of {len(values)} rows differ)")
    if not same_arm:
        failures.append(f"logits aarch64 {path}: not bitwise the aarch64 portable path's")

# The same over the fp32 artifact: ONNX Runtime's ops alone, no kernel, across the two machines.
fp32_logits = {}
for machine in ("x86_64", "aarch64"):
    out = os.path.join(work, f"logits-fp32-{machine}.npy")
    status, _, err, _ = run(machine, "0", [os.path.join(stage, "arm_check_logits.py"), fp32, out, ",".join(map(str, greedy))])
    if status != 0 or not greedy:
        failures.append(f"fp32 logits {machine}: failed: {err}")
        continue
    fp32_logits[machine] = np.load(out)
if len(fp32_logits) == 2:
    a, b = fp32_logits["x86_64"], fp32_logits["aarch64"]
    logit_report["fp32 (ONNX Runtime alone) aarch64 vs x86"] = {
        "bitwise equal": bool(np.array_equal(a.view(np.uint32), b.view(np.uint32))),
        "max |difference|": float(np.abs(a - b).max()), "rows differing": int((a != b).any(axis=1).sum()), "rows": len(a)}
    print(f"logits fp32 artifact (ONNX Runtime's ops alone) aarch64 vs x86: bitwise "
          f"{'equal' if np.array_equal(a.view(np.uint32), b.view(np.uint32)) else 'different'} (max |difference| "
          f"{np.abs(a - b).max():.3g}, {int((a != b).any(axis=1).sum())} of {len(a)} rows differ)")

arm_seconds = sum(r["seconds"] for k, r in results.items() if k.startswith("aarch64"))
summary = {"host": platform.processor() or platform.machine(), "qemu_cpu": os.environ.get("QEMU_CPU"),
           "new_tokens": new_tokens, "runs": results, "comparisons": comparisons, "logits": logit_report,
           "failures": failures, "x86_differences": differences, "aarch64_generate_seconds": round(arm_seconds, 1)}
with open(report, "w") as f:
    f.write(json.dumps(summary, indent=1) + "\n")
print(f"\n{len(results)} generate runs ({arm_seconds:.0f} s of them emulated aarch64); report: {report}")
if failures:
    print("MISMATCH:\n  " + "\n  ".join(failures + differences))
    sys.exit(1)
if differences:
    print("SPEED == plain and the Arm paths == Arm portable, but the ids differ from x86's:\n  " + "\n  ".join(differences))
    sys.exit(3)
print("all equal: SPEED == plain on every path; on aarch64 each kernel path == the portable path (ids and logits "
      "bits); the ids == x86 portable's")
PY
