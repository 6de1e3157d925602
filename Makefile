# Two entry points (see README): `make demo` and `make test`. Both set up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
SPEEDC := $(VENV)/bin/speedc
# A bundled model (zoo:tiny, zoo:small) or a checkpoint directory.
DEMO_MODEL ?= zoo:small
DEMO_PROMPT ?= ROMEO:

.PHONY: setup demo test clean arm-tools

setup: $(VENV)/.installed

# torch first, pinned: 2.13.0 is the CPU build (on this project's machines it installs from local
# disk); an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# Compile the bundled model, generate greedily with SPEED and with plain decoding (same text, see
# the stats), sample with a seed, then benchmark SPEED against plain decoding.
demo: setup
	$(SPEEDC) build $(DEMO_MODEL) -o out/demo --force -v
	$(SPEEDC) generate out/demo --prompt "$(DEMO_PROMPT)" --max-new-tokens 128 --stats
	$(SPEEDC) generate out/demo --prompt "$(DEMO_PROMPT)" --max-new-tokens 128 --stats --mode autoregressive
	$(SPEEDC) generate out/demo --prompt "$(DEMO_PROMPT)" --max-new-tokens 128 --temperature 0.8 --top-k 40 --seed 1 --stream
	$(SPEEDC) bench artifact out/demo --repeats 1

# The kernel's Arm paths are tested under emulation (tests/numeric/test_block_product_arm.py) with Debian's
# cross compiler and qemu-user, installed here where apt-get runs as root (about 20 s); elsewhere
# those tests are skipped with the reason.
arm-tools:
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing gcc-aarch64-linux-gnu and qemu-user for the kernel's Arm tests"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu \
				libc6-dev-arm64-cross qemu-user >/dev/null) || echo "note: could not install them: the Arm tests will be skipped"; \
		else echo "note: no aarch64-linux-gnu-gcc / qemu-aarch64 here: the kernel's Arm tests will be skipped"; fi; \
	fi

# Tests run single-threaded (tests/conftest.py), so two workers use both cores; a file's tests share
# one worker (its module fixtures are built once).
test: setup arm-tools
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf out $(VENV)
