# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Install order matters: torch pinned first (an unpinned torch pulls a multi-GB CUDA build),
# then DeepSpeed without build isolation (it is an sdist that imports torch at build time),
# then bigclip itself.
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.bigclip-installed

.PHONY: install demo test test-fast lint bench clean slurm-deps

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	@$(PY) -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "$(DEEPSPEED)"
	$(PIP) install -e ".[dev]"
	@# OpenCLIP's own model code is the tests' reference; its torchvision dependency has no CPU
	@# build here and is not needed for ViT models, hence --no-deps.
	$(PIP) install --no-deps "open_clip_torch==3.3.0"
	@touch $(STAMP)

demo: install
	$(VENV)/bin/bigclip demo

test: install slurm-deps
	$(PY) -m pytest -q tests

# A real one-node Slurm for tests/test_slurm_cluster.py: Debian's slurm-wlm and munge, installed with
# apt when missing, as root (the tests start their own daemons in a temporary folder). Elsewhere it
# does nothing: the tests then skip, saying why, and fail instead when CI is set.
slurm-deps:
	@if command -v slurmctld >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing slurm-wlm and munge (apt)"; \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } || \
		echo "slurm-deps: apt-get failed: the Slurm tests will skip (and fail under CI)"; \
	else echo "slurm-deps: no root or no apt-get: the Slurm tests will skip"; fi

lint: install
	$(VENV)/bin/ruff check bigclip tests benchmarks
	$(VENV)/bin/ruff format --check bigclip tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
