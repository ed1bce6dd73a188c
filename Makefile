# The README's commands. `make install` once, then `make serve` or `make test`.
PY ?= python
# CPU torch by default; on a GPU host: make install TORCH_INDEX_URL=https://pypi.org/simple (PyPI's Linux wheel
# bundles CUDA) or a CUDA index such as https://download.pytorch.org/whl/cu128
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: install serve test lint bench demo-pair lock smoke
install:
	$(PY) -m pip install torch==2.13.0 --index-url $(TORCH_INDEX_URL)
	$(PY) -m pip install -e ".[test]"

serve:
	dflash-serve

test:
	$(PY) -m pytest -q

lint:
	ruff check .

bench:
	dflash-bench offline
demo-pair:
	$(PY) -m dflash_core.demo.build

# docker/requirements.lock from pyproject.toml (needs pip-tools, CPython 3.11 on linux x86_64)
lock:
	docker/lock.sh

# builds the image and checks it end to end (needs docker or podman and the network)
smoke:
	docker/smoke.sh
