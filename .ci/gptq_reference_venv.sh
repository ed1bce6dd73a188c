#!/usr/bin/env bash
# The interpreter tests/test_quant_gptq_awq.py runs GPTQModel in (tests/gptq_awq_reference.py writes the GPTQ and
# AWQ checkpoints and runs transformers' reference forward of them): a venv holding GPTQModel and optimum only,
# borrowing torch, transformers and the rest from the interpreter given (a .pth file), so the tests' reference runs
# on the same torch and transformers as the code under test (GPTQModel and pypcre build from source: gcc, which
# .ci/run installs). GPTQModel stays out of the project's own environment:
# it pulls torchao, which transformers then imports in every process that loads a model (seconds and warnings at
# each server start), and it pins numpy. Built once and cached under $DFLASH_CI_CACHE (~/.cache/dflash-ci), keyed by
# the borrowed environment and the pins; cold ~1-2 min of installs, cached: instant.
# Usage: .ci/gptq_reference_venv.sh [python]; prints the venv's python on its last line.
set -euo pipefail

PY=${1:-python3}
CACHE=${DFLASH_CI_CACHE:-$HOME/.cache/dflash-ci}
# pinned: GPTQModel 7.7 requires torch>=2.14.1 (pip would replace torch with a CUDA build); transformers' GPTQ
# loading needs optimum
PINS=("gptqmodel==7.6.0" "optimum>=2.0,<3")

site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# keyed by the borrowed environment itself (its path and every distribution in it, so an install or removal there
# rebuilds: pip counted what it found there as installed) and the pins
key=$( { "$PY" --version; echo "$site"; echo "${PINS[*]}"; find "$site" -maxdepth 1 -name '*.dist-info' | sort; } |
       sha256sum | cut -c1-16)
venv=$CACHE/gptq-ref-$key
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$CACHE"
  "$PY" -m venv "$venv"
  own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$site" >"$own/borrowed.pth"  # after the venv's own packages: GPTQModel's numpy pin wins in this venv only
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${PINS[@]}" >&2
  "$venv/bin/python" -c 'import gptqmodel, optimum.gptq' >/dev/null
  touch "$venv/.complete"
  # older builds for the same environment go (other environments' venvs stay: another clone may be using one)
  for old in "$CACHE"/gptq-ref-*; do
    if [ "$old" != "$venv" ] && grep -qxF "$site" "$old"/lib/python*/site-packages/borrowed.pth 2>/dev/null; then
      rm -rf "$old"
    fi
  done
fi
echo "$venv/bin/python"
