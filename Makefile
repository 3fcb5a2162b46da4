# Every target here is exactly what CI runs (see .ci/run); `make test` reproduces CI locally.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: venv demo test test-slow wheel-test lint docs bench bench-record bench-scale gpu-check etcd clean

$(STAMP): pyproject.toml
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { echo "need Python >= 3.11 (python3.11 or python3 on PATH, or make PY=...)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m mnemojax demo $(ARGS)

# Runs (a)-(c) in the bench's process and (d), then (e) mnemojax launch and (f) the classical
# jax.distributed job restarted whole, 4 processes each, one SIGKILLed from outside
# (ARGS=--no-processes skips them).
bench: $(STAMP)
	$(BIN)/python -m mnemojax bench --preset tiny --out runs/bench-tiny $(ARGS)

bench-record: $(STAMP)
	$(BIN)/python -m mnemojax bench --preset gpt10m --out runs/bench-gpt10m $(ARGS)

# Recovery time, snapshot overhead and snapshot host memory at ~0.1 M, 11 M and 40 M
# parameters (one process, 8 CPU devices): a table and runs/scale/scale.png. ~15 min here.
bench-scale: $(STAMP)
	$(BIN)/python -m mnemojax._src.bench.scale --out runs/scale $(ARGS)

# On a GPU (a CUDA jaxlib in .venv: pip install "jax[cuda12]>=0.10,<0.11"): device-to-host snapshot
# throughput against the PCIe peak, the every-step snapshot overhead and the step overhead
# against plain nnx.jit, in one table. Skips without a GPU; ARGS="--platform cpu" runs the
# same check on CPU devices.
gpu-check: $(STAMP)
	$(BIN)/python -m mnemojax._src.bench.gpu_check $(ARGS)

# The etcd server the multi-node tests run (Debian's etcd-server 3.4; root or sudo). Where
# it cannot be installed those tests skip with the reason; everything else runs without it.
etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo -n ); \
	  { $$SUDO apt-get update -q && $$SUDO apt-get install -y -q etcd-server etcd-client; } >/dev/null 2>&1 \
	  || echo "make etcd: could not install etcd-server (the multi-node tests will skip)"; }

test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(ARGS)

# Builds the wheel, installs it in a fresh venv in a temp dir, runs demo + bench there.
wheel-test: $(STAMP)
	$(BIN)/python -m pytest -q -m wheel tests/packaging_test.py $(ARGS)

# ruff, then the type gate: pyright in standard mode over mnemojax/ ([tool.pyright]).
lint: $(STAMP)
	$(BIN)/python -m ruff check mnemojax models tests
	$(BIN)/pyright

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

# API reference of mnemojax, mnemojax.errors, .retry and .testing (docs/api) into
# build/docs/api; any Sphinx warning fails the build.
docs: $(DOCS_STAMP)
	rm -rf build/docs
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs/api build/docs/api

clean:
	rm -rf $(VENV) .pytest_cache runs
