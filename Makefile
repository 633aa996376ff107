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

.PHONY: install demo test test-fast lint bench clean

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

test: install
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check bigclip tests benchmarks
	$(VENV)/bin/ruff format --check bigclip tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
