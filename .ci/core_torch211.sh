#!/usr/bin/env bash
# CI's short job (issue 23): the core tests (`pytest -m core`, tests/conftest.py lists them) on the GPU host's
# software, on CPU: torch 2.11.0 and transformers 5.17.0 (the oldest we support), Python 3.12 when this machine
# has one. The package index has no CPU wheel of torch 2.11: PyPI's Linux wheel is the CUDA build, which does not
# import without its nvidia-* wheels (libcudnn.so.9 and the rest are linked), ~4.6 GB in all. So the venv is built
# once and cached under $DFLASH_CI_CACHE (~/.cache/dflash-ci), keyed by the Python, the pins and pyproject's
# dependencies. Cold: ~2-4 min of installs; cached: seconds. Usage: .ci/core_torch211.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${CORE_TORCH:-2.11.0}
TRANSFORMERS=${CORE_TRANSFORMERS:-5.17.0}
CACHE=${DFLASH_CI_CACHE:-$HOME/.cache/dflash-ci}

# Python 3.12 as on the GPU host: on PATH, else a pyenv install (its shim fails when 3.12 is not selected)
py=""
for cand in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if [ -n "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    py=$cand
    break
  fi
done
if [ -z "$py" ]; then
  py=python3
  echo "core-torch211: no Python 3.12 here; running on $("$py" --version 2>&1)" >&2
fi

# the package's own dependencies less torch and transformers (pinned above), pytest, and what tests/test_quant.py
# builds its checkpoints and references with
deps=$("$py" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
names = lambda spec: re.split(r"[\s\[<>=!~;]", spec, maxsplit=1)[0].lower()
keep = [d for d in project["dependencies"] if names(d) not in ("torch", "transformers")]
dev = [d for d in project["optional-dependencies"]["dev"] if names(d) in ("pytest", "pytest-timeout")]
# tests/test_quant.py's references: transformers' FP8 loading needs accelerate; compressed-tensors writes checkpoints
quant = [d for d in project["optional-dependencies"]["test"] if names(d) in ("accelerate", "compressed-tensors")]
print("\n".join(keep + dev + quant))
PY
)
key=$( { "$py" --version; echo "torch==$TORCH transformers==$TRANSFORMERS"; echo "$deps"; } | sha256sum | cut -c1-16)
venv=$CACHE/core-torch211-$key
start=$SECONDS
if [ ! -f "$venv/.complete" ]; then
  rm -rf "$venv"
  mkdir -p "$CACHE"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  mapfile -t dep_list <<<"$deps"
  "$venv/bin/python" -m pip install -q "torch==$TORCH" "transformers==$TRANSFORMERS" "${dep_list[@]}"
  touch "$venv/.complete"
  # older cached venvs of this job (other pins) go
  find "$CACHE" -maxdepth 1 -name 'core-torch211-*' ! -path "$venv" -exec rm -rf {} +
fi
# this checkout, without dependencies (its transformers pin is the newest release's)
"$venv/bin/python" -m pip install -q --no-deps -e .
echo "core-torch211: venv ready in $((SECONDS - start)) s ($venv)" >&2
"$venv/bin/python" -c 'import sys, torch, transformers; print("core-torch211: Python", sys.version.split()[0],
  "torch", torch.__version__, "transformers", transformers.__version__)'

# only the core files are collected: the others import the dev and test extras (openai, jsonschema, ...)
mapfile -t files < <("$venv/bin/python" -c 'from tests.conftest import CORE_FILES; print(*CORE_FILES, sep="\n")')
start=$SECONDS
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m core "${files[@]/#/tests/}" "$@"
echo "core-torch211: tests took $((SECONDS - start)) s" >&2
