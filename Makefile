# The README's commands. `make install` once, then `make serve` or `make test`.
PY ?= python

.PHONY: install serve test lint bench demo-pair
install:
	$(PY) -m pip install torch==2.13.0
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
