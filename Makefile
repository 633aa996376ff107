# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Install order matters: torch pinned first (an unpinned torch pulls a multi-GB CUDA build),
# then DeepSpeed without build isolation (it is an sdist that imports torch at build time),
# then bigclip itself with every optional extra and the test tools (`.[dev]`).
PYTHON ?= python3
TORCH ?= torch==2.13.0
DEEPSPEED ?= deepspeed==0.19.8
OPEN_CLIP ?= open_clip_torch==3.3.0
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.bigclip-installed

# make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 OUT=DIR [EXTRAS=s3,deepspeed,int8]
PY ?= 3.12
PLATFORM ?= manylinux_2_28_x86_64
OUT ?= wheelhouse
EXTRAS ?= s3,deepspeed,int8

# make bench-gpu [BENCH_PYTHON=python3] [ROWS="engines-fsdp loss-chunked ..."] [QUICK=1]
# Runs with the repository on PYTHONPATH: a GPU node needs torch, not a bigclip install.
BENCH_PYTHON ?= $(PYTHON)
ROWS ?=
QUICK ?=

# The tests start thousands of Python processes that import bigclip: where the environment forbids
# writing bytecode (PYTHONDONTWRITEBYTECODE, set in some CI images), each one that imports the
# training loop compiled its 138 modules anew (0.3-0.4 s of CPU on a 2-core box).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast test-main test-low ds-ops-main ds-ops-low ref-venv lint bench bench-gpu wheelhouse gpu-wheels clean slurm-deps

# A wheel fetched from a network index can break off mid-download (seen on the development box:
# pip's six resumes stuck at one byte count): three tries, 30 s apart, for a transient failure.
RETRY = for try in 1 2 3; do $(1) && break; [ $$try = 3 ] && exit 1; echo "make: attempt $$try of 3 failed; retrying in 30 s"; sleep 30; done

# Both venvs' editable installs write bigclip.egg-info in this folder, and `make test` runs them side
# by side: one at a time.
ONE_AT_A_TIME := $(if $(shell command -v flock),flock $(abspath .egg-info.lock),)

install: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

$(STAMP): $(VPY) pyproject.toml
	@$(VPY) -c "import torch" 2>/dev/null || { $(call RETRY,$(PIP) install "$(TORCH)"); }
	@$(VPY) -c "import deepspeed" 2>/dev/null || { $(call RETRY,DS_BUILD_OPS=0 $(PIP) install --no-build-isolation "$(DEEPSPEED)"); }
	$(call RETRY,$(ONE_AT_A_TIME) $(PIP) install -e ".[dev]")
	@# OpenCLIP's own model code is the tests' reference; its torchvision dependency has no CPU
	@# build here and is not needed for ViT models, hence --no-deps.
	$(PIP) install --no-deps "$(OPEN_CLIP)"
	@touch $(STAMP)

demo: install
	$(VENV)/bin/bigclip demo

# OpenCLIP's whole package (its factory imports torchvision) for the reference tests, in a venv
# of its own: the torchvision wheel the registry serves is a CUDA build that cannot be imported
# beside the CPU torch above. torch + torchvision + open_clip_torch (+ braceexpand, pandas and
# webdataset, which its trainer open_clip_train.main imports, at its training extra's pin: 3.3.0's
# shard reader predates webdataset 1.0's end-of-shard marker; + tensorboard, for its
# --report-to tensorboard): ~5.5 GB, 1-3 minutes from a local index; created once, reused after
# (tests/support/reference_venv.py).
REF_VENV ?= .venv-ref
REF_TORCH ?= torch==2.14.1 torchvision==0.29.1
REF_WDS := webdataset==0.2.86
REF_PY := $(abspath $(REF_VENV))/bin/python
ref-venv:
	@$(REF_PY) -c "import open_clip, torchvision, braceexpand, pandas, tensorboard; from importlib.metadata import version; assert '$(REF_WDS)' == 'webdataset==' + version('webdataset')" 2>/dev/null || ( \
	    $(PYTHON) -m venv $(REF_VENV) && \
	    { $(call RETRY,$(REF_VENV)/bin/python -m pip install -q --no-cache-dir $(REF_TORCH) ftfy regex tqdm safetensors braceexpand pandas tensorboard "$(REF_WDS)"); } && \
	    $(REF_VENV)/bin/python -m pip install -q --no-cache-dir --no-deps "$(OPEN_CLIP)" )

# Both stacks: the whole suite on the main one, then the low stack's subset, whatever the first gave
# (one run reports both; the exit status fails if either did). The four installs and each stack's
# DeepSpeed op come first, side by side (downloads, unpacking and a compile, minutes each), each
# target's output kept together; one that failed is tried again, and says why, by the tier that
# needs it.
test:
	@$(MAKE) --no-print-directory -k -j 4 --output-sync=target ds-ops-main slurm-deps ref-venv ds-ops-low || true
	@status=0; $(MAKE) --no-print-directory test-main || status=1; \
	$(MAKE) --no-print-directory test-low || status=1; exit $$status

# The inner loop's tier, under 5 minutes on 2 cores: one process per test (no gloo ranks, no
# cluster, no reference venv, no second stack), none marked slow, and not the bad-input suite; in
# two workers as `make test` (one took 8 minutes for its 1,100 tests).
FAST_MARKERS := not dist and not slow and not gpu and not bad_input
test-fast: install
	TORCH_EXTENSIONS_DIR=$(MAIN_EXT) $(VPY) -m pytest -q $(XDIST) --durations=10 -m "$(FAST_MARKERS)" tests

# DeepSpeed builds its shared-memory collective op (ninja, gcc) on its first CPU run, under a lock
# file in TORCH_EXTENSIONS_DIR. A run killed mid-build (the preemption tests kill DeepSpeed jobs)
# leaves the lock behind, and every later DeepSpeed start waits on it for ever ("building the model:
# still running after ..."). So each stack builds it before its tests, in a folder of its own (the
# op is per torch build; the default ~/.cache/torch_extensions/py311_cpu is every venv's).
# Once built, loading it again takes seconds.
DS_OPS = TORCH_EXTENSIONS_DIR=$(2) $(1) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)"
MAIN_EXT := $(abspath $(VENV))/torch_extensions
LOW_EXT = $(abspath $(LOW_VENV))/torch_extensions
ds-ops-main: install
	$(call DS_OPS,$(VPY),$(MAIN_EXT))

# Two pytest-xdist workers, one test file a unit of work (tests/conftest.py says how and why). The
# suite keeps two cores busy (its ranks are the workers' own processes): a third worker slowed it.
XDIST := -n 2
test-main: ds-ops-main slurm-deps ref-venv
	TORCH_EXTENSIONS_DIR=$(MAIN_EXT) BIGCLIP_REFERENCE_PYTHON=$(REF_PY) $(VPY) -m pytest -q $(XDIST) --durations=30 tests

# The low stack (.venv-low): torch 2.11.0 with the Triton it pins (3.6.0), the GPU machines' stack,
# and every other direct dependency at the lower bound pyproject.toml declares, so the bounds are
# what a test ran on. tests/support/stacks.py writes the constraints and lists the subset that runs
# here (engines, training loop, loss, int8, data on the device, checkpoints, and the tests of the
# dependencies installed at their bound). torch 2.11.0 is the registry's CUDA build (4.6 GB with
# its NVIDIA libraries), which runs on CPU.
LOW_VENV ?= .venv-low
LOW_PY := $(LOW_VENV)/bin/python
LOW_STAMP := $(LOW_VENV)/.bigclip-installed
LOW_CONSTRAINTS := $(LOW_VENV)/constraints.txt
STACKS := tests/support/stacks.py

$(LOW_STAMP): pyproject.toml $(STACKS)
	@test -x $(LOW_PY) || { $(PYTHON) -m venv $(LOW_VENV) && $(LOW_PY) -m pip install -q --upgrade pip setuptools wheel; }
	$(PYTHON) $(STACKS) constraints > $(LOW_CONSTRAINTS)
	$(call RETRY,$(LOW_PY) -m pip install -q -c $(LOW_CONSTRAINTS) torch)
	$(call RETRY,DS_BUILD_OPS=0 $(LOW_PY) -m pip install -q --no-build-isolation -c $(LOW_CONSTRAINTS) deepspeed)
	$(call RETRY,$(ONE_AT_A_TIME) $(LOW_PY) -m pip install -q -c $(LOW_CONSTRAINTS) -e ".[dev]")
	$(LOW_PY) -m pip install -q --no-deps "$(OPEN_CLIP)"
	@touch $(LOW_STAMP)

ds-ops-low: $(LOW_STAMP)
	$(call DS_OPS,$(LOW_PY),$(LOW_EXT))

test-low: ds-ops-low ref-venv
	TORCH_EXTENSIONS_DIR=$(LOW_EXT) BIGCLIP_STACK=low \
	    BIGCLIP_REFERENCE_PYTHON=$(REF_PY) $(LOW_PY) -m pytest -q $(XDIST) --durations=30 $$($(PYTHON) $(STACKS) tests)

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

# CPU benchmarks, each a script that prints its table and writes benchmarks/results/NAME.json
# (about an hour on 2 cores; each runs alone too: python benchmarks/NAME.py --help). Run by hand:
# benchmarks/faults.py (root, a real Slurm), loss_exchange_link.py (root, network namespaces) and
# checkpoint_io.py --endpoint (a second S3 server).
bench: install
	$(VPY) benchmarks/loss_memory.py
	$(VPY) benchmarks/loss_time_gloo.py
	$(VPY) benchmarks/engines.py
	$(VPY) benchmarks/switchback.py
	$(VPY) benchmarks/checkpoint_io.py
	$(VPY) benchmarks/consolidate.py
	$(VPY) benchmarks/data_loader.py
	$(VPY) benchmarks/demo_data_learnability.py
	$(VPY) benchmarks/tokenizer.py
	$(VPY) benchmarks/remote_sync.py
	$(VPY) benchmarks/optimizer_step.py
	$(VPY) benchmarks/precision_vs_autocast.py
	$(VPY) benchmarks/normalize_cpu.py

# Every GPU row in its own process under a timeout; results in benchmarks/results/*_gpu.json.
bench-gpu:
	PYTHONPATH=$(CURDIR) $(BENCH_PYTHON) benchmarks/gpu_suite.py $(if $(QUICK),--quick) $(ROWS)

# Wheels of bigclip and its non-torch dependencies (DeepSpeed built into a wheel) for GPU nodes
# without internet: pip install --no-index --find-links OUT 'bigclip[s3,deepspeed,int8]'.
wheelhouse: install
	$(VPY) -m bigclip.launch.wheelhouse --python-version $(PY) --platform $(PLATFORM) \
	    --extras $(EXTRAS) --deepspeed "$(DEEPSPEED)" --out $(OUT)

# The project's GPU machines (torch, Triton, torchvision, pytest, pyyaml, pillow, tensorboard, timm,
# huggingface-hub... and no package index) lack bigclip's braceexpand and ftfy, the fp8 kinds' torchao
# (0.17.0: the release for their torch 2.11), and the peer rows'
# open_clip_torch and inf-cl. `make gpu-wheels` puts them (5.5 MB) into gpu-wheels/ to carry there,
# where `python3 -m pip install -q --no-index --no-deps gpu-wheels/*.whl` installs them.
# tests/test_gpu_image.py checks that the first list is enough.
GPU_IMAGE_LACKS ?= braceexpand ftfy torchao==0.17.0
GPU_PEER_WHEELS ?= $(OPEN_CLIP) inf-cl
gpu-wheels: install
	$(VPY) -m bigclip.launch.wheelhouse --only "$(GPU_IMAGE_LACKS)" --python-version $(PY) \
	    --platform $(PLATFORM) --out gpu-wheels
	$(VPY) -m bigclip.launch.wheelhouse --only "$(GPU_PEER_WHEELS)" --no-deps --python-version $(PY) \
	    --platform $(PLATFORM) --out gpu-wheels

clean:
	rm -rf $(VENV) $(LOW_VENV) runs .pytest_cache
