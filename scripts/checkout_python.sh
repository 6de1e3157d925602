# Sourced by scripts/gpu_check.sh and scripts/kernel_check.sh: PYTHON (absolute; a venv's kept), wheels
# carried in .whl/ installed first when present, and this checkout importable as speedc where speedc is
# not installed, through a staging folder of symlinks (the source folders map onto speedc, speedc.models,
# speedc.passes, speedc.runtimes as pyproject.toml does). The working directory becomes that folder, so
# ./speedc of the checkout never shadows it; REPO is the checkout, STAGE the folder (removed on exit).
PYTHON="${PYTHON:-python3}"
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --find-links "$REPO/.whl" "$REPO"/.whl/*.whl
fi
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cd "$STAGE"
if ! "$PYTHON" -c "import speedc.models.llama, speedc.runtimes.decode" 2>/dev/null; then
    mkdir speedc
    for entry in "$REPO"/speedc/*; do ln -s "$entry" speedc/; done
    for package in models passes runtimes; do ln -s "$REPO/$package" "speedc/$package"; done
    export PYTHONPATH="$STAGE${PYTHONPATH:+:$PYTHONPATH}"
fi
